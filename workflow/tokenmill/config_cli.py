"""`tokenmill check-config CONFIG`: validate a config and print it with defaults filled in."""

from __future__ import annotations

import argparse
import json
import sys

from tokenmill.config import ConfigError, load_config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill check-config")
    parser.add_argument("config")
    parser.add_argument("--basedir", default=".")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.basedir)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    json.dump(config, sys.stdout, indent=2, sort_keys=True)
    print()
    return 0

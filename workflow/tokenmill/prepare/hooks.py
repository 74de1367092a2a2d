"""User hooks of the `hook` format: `module:function` mapping one record to messages."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from tokenmill.settings import ConfigError


def load_hook(spec: str, basedir: str | Path = "."):
    """Import a user hook `module:function`; modules next to the workflow are importable."""
    root = str(Path(basedir).resolve())
    if root not in sys.path:
        sys.path.insert(0, root)
    module_name, _, func_name = spec.partition(":")
    module = importlib.import_module(module_name)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"'{spec}': module '{module_name}' has no function '{func_name}'")
    return func

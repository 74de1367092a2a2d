"""Run by tests/test_hidden_states_trainers.py with the python of tests/specforge/ensure_venv.sh.

Uses SGLang SpecForge's own offline reader (OfflineManifestReader, with its eager validation of
every file's keys and tensors) and its feature-file loader. Argument: a JSON spec {data, out}.
Saves {file path: the tensors SpecForge loaded} to out/loaded.pt.
"""

import json
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from specforge.runtime.data_plane.feature_store import load_feature_file  # noqa: E402
from specforge.runtime.data_plane.offline_reader import OfflineManifestReader  # noqa: E402


def main():
    spec = json.loads(sys.argv[1])
    refs = OfflineManifestReader(spec["data"], validate_files=True).read()
    loaded = {}
    for ref in refs:
        path = ref.feature_store_uri[len("file://") :]
        raw = load_feature_file(path)
        specs = {k: (tuple(s.shape), str(s.dtype)) for k, s in ref.feature_specs.items()}
        loaded[path] = {
            "tensors": {k: raw[k].clone() for k in ref.feature_keys},
            "num_tokens": ref.num_tokens,
            "specs": specs,
        }
    torch.save(loaded, Path(spec["out"]) / "loaded.pt")
    print(f"specforge: ok ({len(loaded)} files)")


if __name__ == "__main__":
    main()

"""The vLLM backend: a vLLM server with `extract_hidden_states` writes each row's states.

Managed (hidden_states.mode: managed): the server is started from hidden_states.launch.command
(generation.launch's placeholders; tokenmill.engines.launch starts, checks and stops it) with
these flags added:

    --speculative-config {"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}}
    --kv-transfer-config {"kv_connector": "CPUSafeHiddenStatesConnector",
        "kv_connector_module_path": "tokenmill.hidden_states.vllm_connector",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": SCRATCH}}
    --no-enable-chunked-prefill

(the connector is vLLM's own on GPUs and avoids pinned memory on CPU: vllm_connector.py; the
package's folder is put on the server's PYTHONPATH). External (mode: external): servers started
that way by someone else, at hidden_states.external.urls, whose storage path this job can read.

Per row: POST /v1/completions {"prompt": ids, "max_tokens": 1, "return_token_ids": true}; the
answer's kv_transfer_params.hidden_states_path names the file; the client waits for the
writer's lock (flock on PATH.lock), reads it, checks its token_ids, deletes it and its lock. The
SpecForge hidden_state is the model's final RMSNorm (its norm weight and eps, read from the
checkpoint) of layer L, computed as transformers' RMSNorm does (in float32, then the dtype).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenmill.hidden_states.hf import RowStates
from tokenmill.settings import GenerationSettings, Settings

CONNECTOR = "CPUSafeHiddenStatesConnector"
CONNECTOR_MODULE = "tokenmill.hidden_states.vllm_connector"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # holds tokenmill/
AUTO_IN_FLIGHT = 16  # max_batch_rows: auto; the server batches the requests in flight


def launch_flags(layers: list[int], scratch: Path) -> list[str]:
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}},
    }
    kv = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(scratch)},
    }
    return [
        "--speculative-config", json.dumps(spec),
        "--kv-transfer-config", json.dumps(kv),
        "--no-enable-chunked-prefill",
    ]  # fmt: skip


def final_norm(model_dir: Path):
    """(weight, eps) of the model's final norm, from its checkpoint and config."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    eps = float((cfg.get("text_config") or cfg).get("rms_norm_eps", 1e-6))
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in ("model.norm.weight", "model.language_model.norm.weight"):
                if key in st.keys():  # noqa: SIM118 - safe_open has keys(), no __contains__
                    return st.get_tensor(key), eps
    raise FileNotFoundError(f"{model_dir}: no model.norm.weight in its safetensors files")


def rms_norm(x, weight, eps: float):
    """transformers' RMSNorm (Llama, Qwen2, Qwen3): float32 statistics, then the input dtype."""
    import torch

    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class VLLMBackend:
    def __init__(
        self, settings: Settings, basedir, model_dir: Path, layers, scratch: Path, log_dir
    ):
        hs = settings.hidden_states
        self.layers = list(layers)
        self.weight, self.eps = final_norm(model_dir)
        self.scratch = Path(scratch)
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)
        self.engine = None
        if hs.mode == "managed":
            from tokenmill.engines.launch import ManagedEngine

            gen = settings.generation.raw
            launch = {
                **gen["launch"],
                "command": list(hs.launch.command) + launch_flags(self.layers, self.scratch),
                "host": hs.launch.host,
                "startup_timeout_s": hs.launch.startup_timeout_s,
                "nnodes": 1,
                "env": {
                    **hs.launch.env,
                    "PYTHONPATH": os.pathsep.join(
                        p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p
                    ),
                },
            }
            model = hs.model or settings.generation.model
            g = GenerationSettings.from_raw(
                {**gen, "engine": "vllm", "mode": "managed", "model": model, "launch": launch}
            )
            self.engine = ManagedEngine(g, log_dir, basedir)
            asyncio.run(self.engine.start())
            self.urls = [self.engine.url]
        else:
            self.urls = list(hs.external.urls)
        self.model_id = self._served_model(self.urls[0])

    @staticmethod
    def _post(url: str, body: dict, timeout: float = 3600) -> dict:
        req = urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def _served_model(self, url: str) -> str:
        with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
            return json.loads(r.read())["data"][0]["id"]

    def _one(self, url: str, index: int, ids: list[int]) -> RowStates:
        from safetensors.torch import load_file

        answer = self._post(
            url + "/v1/completions",
            {"model": self.model_id, "prompt": ids, "max_tokens": 1, "return_token_ids": True},
        )
        params = answer.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise RuntimeError(f"row {index}: no kv_transfer_params.hidden_states_path: {answer}")
        lock = path + ".lock"
        with contextlib.suppress(FileNotFoundError), open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)  # the writer holds LOCK_EX until the file is written
        data = load_file(path)
        os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        if data["token_ids"].tolist() != ids:
            raise RuntimeError(f"row {index}: the server's token_ids differ from the row's")
        states = data["hidden_states"].contiguous()
        return RowStates(index=index, states=states, norm=self._norm)

    def _norm(self, last):
        return rms_norm(last, self.weight.to(last.dtype), self.eps)

    def run(self, rows: dict[int, list[int]], todo, batch_tokens: int, max_rows):
        """RowStates of the rows in `todo`, in row order, `max_rows` requests in flight
        ("auto": 16; the server batches them)."""
        order = sorted(todo)
        in_flight = AUTO_IN_FLIGHT if max_rows == "auto" else int(max_rows)
        with ThreadPoolExecutor(max_workers=in_flight) as pool:
            futures = [
                pool.submit(self._one, self.urls[k % len(self.urls)], i, rows[i])
                for k, i in enumerate(order)
            ]
            for f in futures:
                yield f.result()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)

"""The reference engine with a probe, as a launch command for the SLURM tests.

    python tests/slurm/engine_probe.py [--node-rank R --dist-init-addr A --nnodes N] -- \
        <tokenmill serve-reference arguments>

It runs `tokenmill serve-reference` in-process (the real CPU engine with SGLang's API) and
appends one JSON line per event to the file named by TOKENMILL_PROBE_LOG (relative paths are
relative to the engine's working directory, the workflow's directory):

- `start`: pid, host, SLURM node, rank, head address, SLURM job id/step/restart count,
  CUDA_VISIBLE_DEVICES;
- `request`: one per POST /generate, with a hash of its input_ids (counted by the tests);
- `stop`: when the engine has shut down (after SIGTERM).

Each line is one O_APPEND write, so lines from concurrent engines never interleave and a line
survives a SIGKILL right after it. TOKENMILL_PROBE_DELAY_S (float) delays every /generate by
that many seconds, to make a shard take long enough to hit a SLURM time limit.

With --node-rank > 0 it stands in for a non-head rank of a multi-node engine: it serves no HTTP
(SGLang's other ranks do not either) and waits for SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time


def _env(name: str) -> str | None:
    return os.environ.get(name)


class Probe:
    def __init__(self, rank: int, head: str | None, nnodes: int):
        self.path = _env("TOKENMILL_PROBE_LOG")
        self.base = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node": _env("SLURMD_NODENAME"),  # n1/n2 share a host name on the test cluster
            "rank": rank,
            "dist_init_addr": head,
            "nnodes": nnodes,
            "job": _env("SLURM_JOB_ID"),
            "step": _env("SLURM_STEP_ID"),
            "procid": _env("SLURM_PROCID"),
            "restart_count": _env("SLURM_RESTART_COUNT"),
        }

    def write(self, event: str, **fields) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "t": round(time.time(), 3), **self.base, **fields})
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def _patch_reference_api(probe: Probe, delay_s: float) -> None:
    from aiohttp import web

    from tokenmill.testing import reference_api

    make_app = reference_api.make_app

    @web.middleware
    async def probe_middleware(request, handler):
        if request.method in ("POST", "PUT") and request.path == "/generate":
            try:
                body = await request.json()  # aiohttp caches the body for the handler
            except ValueError:
                body = {}
            ids = body.get("input_ids") if isinstance(body, dict) else None
            digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
            probe.write("request", input_hash=digest)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
        return await handler(request)

    def probed_make_app(engine):
        app = make_app(engine)
        app.middlewares.append(probe_middleware)
        return app

    reference_api.make_app = probed_make_app
    serve = reference_api.serve

    async def probed_serve(args):
        # reference_api.main ends with os._exit (no finally runs after it): log here.
        try:
            return await serve(args)
        finally:
            probe.write("stop")

    reference_api.serve = probed_serve


def _wait_for_sigterm() -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Bounded: a stray rank never outlives a test run by more than an hour.
    stop.wait(timeout=3600)
    return 0


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        own, server_args = argv[:split], argv[split + 1 :]
    else:
        own, server_args = [], argv
    p = argparse.ArgumentParser(prog="engine_probe.py")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None)
    p.add_argument("--nnodes", type=int, default=1)
    a = p.parse_args(own)
    probe = Probe(a.node_rank, a.dist_init_addr, a.nnodes)
    probe.write(
        "start",
        cuda_visible_devices=_env("CUDA_VISIBLE_DEVICES"),
        slurm_step_gpus=_env("SLURM_STEP_GPUS") or _env("SLURM_JOB_GPUS"),
    )
    if a.node_rank > 0:
        try:
            return _wait_for_sigterm()
        finally:
            probe.write("stop")
    _patch_reference_api(probe, float(_env("TOKENMILL_PROBE_DELAY_S") or 0))
    from tokenmill.testing import reference_api

    return reference_api.main(server_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

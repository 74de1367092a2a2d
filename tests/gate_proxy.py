"""A pass-through HTTP proxy in front of a real engine that can hold generation requests.

Why: the kill tests must interrupt a shard *mid-way*. Polling the journal and then sending a
signal is a race: vLLM on CPU answers ~50 requests/s, so on a loaded 2-core machine the whole
shard can finish between the poll and the kill (CI saw exactly that). With this proxy the test
sets how many generation requests pass; the next one is held (never reaches the engine) until the
gate file is removed or raised. The journal then stops at an exact count, and the kill lands
mid-shard however slow the test process is scheduled.

Usage (as the launch command tokenmill runs):
    python tests/gate_proxy.py --port {port} --gate-file F --gate-path /generate \
        -- <engine argv, with @INNER_PORT@ where the engine's own port goes>

The gate file holds an integer N: this proxy (one per engine start) forwards N gated requests,
then holds the rest while the file holds N. No file: everything passes. The engine runs as our
child with PDEATHSIG=SIGTERM, so killing the proxy (or its process group) takes the engine with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

from tokenmill.engines.launch import free_port, set_pdeathsig

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def hold_limit(path) -> int | None:
    """N from a gate/hold file: requests after the Nth wait while it says so (no file: none).
    Shared with fake_sglang.py's --hold-file."""
    if not path:
        return None
    try:
        return int(Path(path).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--gate-file", type=Path, required=True)
    ap.add_argument("--gate-path", required=True)
    ap.add_argument("engine", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    import psutil  # here: fake_sglang.py imports this module for hold_limit alone

    engine_argv = [a for a in args.engine if a != "--"]
    inner = free_port()
    engine_argv = [a.replace("@INNER_PORT@", str(inner)) for a in engine_argv]
    engine = subprocess.Popen(engine_argv, preexec_fn=set_pdeathsig)
    upstream = f"http://127.0.0.1:{inner}"
    forwarded = 0
    engine_listens = False

    def listens_on_inner() -> bool:
        # Another process may take `inner` between free_port() and the engine's bind (a CI run:
        # a reference engine of the other xdist worker answered, with 404s): forward only once
        # the listener there is our engine (or its child), and say "not ready" until then.
        nonlocal engine_listens
        if not engine_listens:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(engine.pid)
                engine_listens = any(
                    c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == inner
                    for proc in (root, *root.children(recursive=True))
                    for c in proc.net_connections(kind="tcp")
                )
        return engine_listens

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal forwarded
        if not listens_on_inner():
            return web.Response(status=503, text="engine not listening yet")
        if request.method == "POST" and request.path == args.gate_path:
            while (n := hold_limit(args.gate_file)) is not None and forwarded >= n:
                await asyncio.sleep(0.05)
            forwarded += 1
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        session: aiohttp.ClientSession = request.app["session"]
        try:
            async with session.request(
                request.method, upstream + request.path_qs, data=body, headers=headers
            ) as r:
                payload = await r.read()
                out = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS}
                return web.Response(status=r.status, body=payload, headers=out)
        except aiohttp.ClientConnectionError:
            return web.Response(status=502, text="engine not reachable")

    async def on_startup(app):
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def on_cleanup(app):
        await app["session"].close()

    async def watch_engine(app):
        # The proxy lives exactly as long as its engine: an engine that exits ends the proxy.
        async def watch():
            while engine.poll() is None:
                await asyncio.sleep(0.2)
            print(f"gate_proxy: engine exited with {engine.returncode}", flush=True)
            os._exit(engine.returncode or 1)

        task = asyncio.create_task(watch())
        yield
        task.cancel()

    def on_signal(signum, _frame):
        # Exit at once, like an engine would; a graceful aiohttp shutdown would wait up to a
        # minute for a held request. The engine gets SIGTERM here and again from PDEATHSIG.
        if engine.poll() is None:
            engine.terminate()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.cleanup_ctx.append(watch_engine)
    web.run_app(
        app, host=args.host, port=args.port, print=None, access_log=None, handle_signals=False
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

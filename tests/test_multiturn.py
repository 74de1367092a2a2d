"""context: regenerated: every assistant turn regenerated in order on the model's own earlier
turns, token-exact (docs/multi-turn.md). Real CLI runs: prepare -> tokenize -> generate against
the reference engine (`tokenmill serve-reference`, the demo model in sample/model) -> merge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tokenmill import contracts
from tokenmill.prepare import formats
from tokenmill.tokenization import conversations as conv

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "workflow" / "tokenmill" / "testing" / "templates"
STOP = "<|im_end|>"

CONVERSATIONS = [
    [("user", "What is 2 plus 2?"), ("assistant", "4"), ("user", "Name a color."),
     ("assistant", "Blue."), ("user", "Say hello in Spanish."), ("assistant", "Hola.")],
    [("system", "Be brief."), ("user", "What is the capital of France?"),
     ("assistant", "Paris."), ("user", "Reverse the string abc."), ("assistant", "cba")],
    [("user", "Explain binary search."), ("assistant", "Split it."),
     ("user", "Write a function that adds two numbers.")],
]  # fmt: skip


def write_data(path: Path, convs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for c in convs:
            f.write(json.dumps({"messages": [{"role": r, "content": t} for r, t in c]}) + "\n")


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "tokenmill", *args], capture_output=True, text=True,
                       cwd=REPO, timeout=timeout)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    return p


class Pipeline:
    """One category through prepare, tokenize, generate and merge in `tmp`. `gen` overrides
    keys of the generation config (another engine: tests/test_engines_real.py)."""

    def __init__(self, tmp: Path, tok_cfg: dict, think_end: str | None, journal: Path,
                 gen: dict | None = None, generate_timeout: float = 180):  # fmt: skip
        self.tmp, self.tok_cfg, self.think_end, self.journal = tmp, tok_cfg, think_end, journal
        self.generate_timeout = generate_timeout
        self.gen = {
            "engine": "sglang", "mode": "managed", "model": "sample/model", "revision": None,
            "launch": {"command": ["{python}", "-m", "tokenmill", "serve-reference",
                                   "--model-path", "{model}", "--skip-tokenizer-init",
                                   "--host", "{host}", "--port", "{port}"],
                       "host": "127.0.0.1", "startup_timeout_s": 60},
            "sampling": {"max_new_tokens": 40, "temperature": 0.0}, "stop_tokens": [STOP],
            "seed_policy": "none", "concurrency": 8, "request_timeout_s": 60,
            "retry": {"max_attempts": 2, "backoff_initial_s": 0.05, "backoff_max_s": 0.1},
            "progress_interval_s": 5,
        } | (gen or {})  # fmt: skip
        (tmp / "gen.json").write_text(json.dumps(self.gen))
        (tmp / "tok.json").write_text(json.dumps(tok_cfg))

    def run(self, data: Path, tag: str) -> dict:
        t = self.tmp / tag
        t.mkdir()
        cat = {"sources": [str(data)], "format": "messages", "context": "regenerated"}
        cli("prepare", "--category", "mt", "--category-config", json.dumps(cat),
            "--out", str(t / "p.parquet"), "--rejected", str(t / "pr.parquet"))  # fmt: skip
        cli("tokenize", "--prompts", str(t / "p.parquet"), "--category", "mt", "--shards", "1",
            "--tokenizer-config", str(self.tmp / "tok.json"), "--max-prompt-tokens", "2048",
            "--out-dir", str(t / "tok"), "--rejected", str(t / "tr.parquet"),
            "--stop-tokens", json.dumps([STOP]),
            f"--think-end-token={self.think_end or ''}")  # fmt: skip
        cli("generate", "--generation-config", str(self.tmp / "gen.json"),
            "--tokenizer-config", str(self.tmp / "tok.json"), "--category", "mt",
            "--shard", "000", "--tokenized", str(t / "tok" / "000.parquet"),
            "--out", str(t / "g.parquet"), "--rejected", str(t / "r.parquet"),
            "--meta", str(t / "m.json"), "--journal-dir", str(self.journal),
            "--log-dir", str(t / "logs"), timeout=self.generate_timeout)  # fmt: skip
        ds = {"max_sequence_tokens": 4096, "reject_truncated": True,
              "think_end_token": self.think_end}  # fmt: skip
        (t / "ds.json").write_text(json.dumps(ds))
        cli("merge", "--category", "mt", "--shard", "000", "--tokenized",
            str(t / "tok" / "000.parquet"), "--generated", str(t / "g.parquet"),
            "--generate-rejected", str(t / "r.parquet"), "--out", str(t / "d.parquet"),
            "--rejected", str(t / "dr.parquet"), "--dataset-config", str(t / "ds.json"),
            "--generation-config", str(self.tmp / "gen.json"),
            "--tokenizer-config", str(self.tmp / "tok.json"))  # fmt: skip
        return {
            "dir": t,
            "tok": pq.read_table(t / "tok" / "000.parquet"),
            "gen": pq.read_table(t / "g.parquet"),
            "meta": json.loads((t / "m.json").read_text()),
            "dataset": pq.read_table(t / "d.parquet"),
            "dataset_meta": contracts.read_metadata(t / "d.parquet"),
        }


def _turns(gen):
    """{prompt_id: [(turn prompt ids, output ids), ...]} in turn order."""
    out: dict[str, list] = {}
    for r in gen.to_pylist():
        turn = (r["turn"], r["turn_prompt_ids"], r["output_ids"])
        out.setdefault(r["prompt_id"], []).append(turn)
    return {k: [(p, o) for _, p, o in sorted(v)] for k, v in out.items()}


def _load(tok_cfg):
    from tokenmill.tokenization.tokenizer import load_tokenizer

    return load_tokenizer(tok_cfg, REPO)


def check_turn_prompts(tok, r: dict, kwargs: dict) -> dict:
    """Each generated turn's prompt equals apply_chat_template of the conversation with the
    model's own earlier answers, split at "</think>" (a template that is not prefix-exact).
    Returns _turns(r["gen"])."""
    stop, think = tok.convert_tokens_to_ids(STOP), tok.convert_tokens_to_ids("</think>")
    rows = {row["prompt_id"]: row for row in r["tok"].to_pylist()}
    turns = _turns(r["gen"])
    for pid, ts in turns.items():
        messages = json.loads(rows[pid]["messages"])
        tools = json.loads(rows[pid]["tools"]) if rows[pid]["tools"] else None
        spans = formats.turn_spans(messages)
        history: list[dict] = []
        pos = 0
        for k, (prompt, output) in enumerate(ts):
            a, e = spans[k]
            history += messages[pos:a]
            expected = tok.apply_chat_template(history, tools=tools, add_generation_prompt=True,
                                               tokenize=True, return_dict=False,
                                               **kwargs)  # fmt: skip
            assert prompt == list(expected), (pid, k)
            if rows[pid]["tool_call_ids"][k] is not None:
                # A tool-call turn continues only when the model's ids are the dataset's, with
                # the dataset's messages.
                assert k == len(ts) - 1 or output == rows[pid]["tool_call_ids"][k], (pid, k)
                history += messages[a:e]
                pos = e
                continue
            # The token-level split, written out independently of the package.
            ids = output[:-1] if output[-1] == stop else output
            if think in ids:
                cut = ids.index(think)
                history.append({"role": "assistant", "content": tok.decode(ids[cut + 1 :]),
                                "reasoning_content": tok.decode(ids[:cut])})  # fmt: skip
            else:
                history.append({"role": "assistant", "content": tok.decode(ids)})
            pos = e
    return turns


# ----------------------------------------------------------------------------- unit


def test_turn_spans_and_one_prompt_per_conversation():
    msgs = [{"role": r, "content": "x"} for r in ("system", "user", "assistant", "assistant",
                                                  "user", "assistant", "user")]  # fmt: skip
    assert formats.turn_spans(msgs) == [(2, 4), (5, 6), (7, 7)]
    record = {"messages": msgs}
    whole = formats.to_prompts(record, "messages", context="regenerated")
    assert len(whole) == 1 and whole[0][1] == msgs
    assert len(formats.to_prompts(record, "messages", turns="all")) == 2


@pytest.mark.parametrize(
    ("template", "kwargs", "think", "exact"),
    [("kimi", {"thinking": True}, True, False),  # earlier reasoning dropped: <think></think>
     ("qwen3", {}, True, False),  # reasoning_content not rendered for history
     ("qwen3", {}, False, True),  # a model that does not think: content is rendered verbatim
     ("chatml", {}, False, True)],
)  # fmt: skip
def test_template_prefix_exact_probe(tmp_path, template, kwargs, think, exact):
    from tokenmill.testing.tiny_model import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path, template=template)
    stop = [tok.convert_tokens_to_ids(STOP)]
    think_id = tok.convert_tokens_to_ids("</think>") if think else None
    assert conv.template_prefix_exact(tok, kwargs, stop, think_id) is exact


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def kimi_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kimi")
    write_data(tmp / "data" / "a.jsonl", CONVERSATIONS)
    tok_cfg = {"path": "sample/model", "chat_template_kwargs": {"thinking": True}}
    pipe = Pipeline(tmp, tok_cfg, "</think>", tmp / "journal")
    return pipe, pipe.run(tmp / "data" / "a.jsonl", "first")


def test_kimi_each_turn_prompt_is_the_template_of_the_models_own_answers(kimi_run):
    pipe, r = kimi_run
    assert r["tok"].column("prefix_exact").to_pylist() == [False] * len(CONVERSATIONS)
    turns = check_turn_prompts(_load(pipe.tok_cfg), r, pipe.tok_cfg["chat_template_kwargs"])
    assert sum(len(v) for v in turns.values()) > len(CONVERSATIONS)  # later turns were generated
    # one sample per turn, every turn's output under the loss mask
    assert r["dataset"].num_rows == r["gen"].num_rows
    assert r["dataset_meta"]["tokenmill.turn_samples"] == str(r["gen"].num_rows)


def test_kill_between_turns_resumes_at_the_first_unjournaled_turn(kimi_run, tmp_path):
    pipe, first = kimi_run
    total = first["gen"].num_rows
    # A job killed after 2 turns were journaled: keep only those journal lines.
    journal = tmp_path / "journal"
    import shutil

    shutil.copytree(pipe.journal, journal)
    files = sorted((journal / "mt").glob("*.jsonl"))
    lines = [ln for f in files for ln in f.read_text().splitlines(keepends=True)]
    assert len(lines) == total
    for f in files:
        f.unlink()
    (journal / "mt" / "000.a.jsonl").write_text("".join(lines[:2]))
    resumed = Pipeline(tmp_path, pipe.tok_cfg, pipe.think_end, journal)
    r = resumed.run(pipe.tmp / "data" / "a.jsonl", "resumed")
    assert r["meta"]["counts"]["requested"] == total - 2
    assert r["meta"]["counts"]["turns_from_journal"] == 2
    cols = ["prompt_id", "turn", "sample_key", "turn_prompt_ids", "output_ids", "conversation_end"]
    assert r["gen"].select(cols).equals(first["gen"].select(cols))


def test_one_turn_edit_regenerates_that_conversation_from_that_turn(kimi_run, tmp_path):
    pipe, first = kimi_run
    edited = [list(c) for c in CONVERSATIONS]
    edited[0][4] = ("user", "Name a color.")  # turn 3's question of the first conversation
    write_data(tmp_path / "data" / "b.jsonl", edited)
    again = Pipeline(tmp_path, pipe.tok_cfg, pipe.think_end, pipe.journal)
    r = again.run(tmp_path / "data" / "b.jsonl", "edited")
    # turns 1 and 2 of the edited conversation and every other conversation: from the journal
    assert r["meta"]["counts"]["requested"] == 1
    before, after = _turns(first["gen"]), _turns(r["gen"])
    changed = set(after) - set(before)
    assert len(changed) == 1
    (old,) = set(before) - set(after)
    assert after[changed.pop()][:2] == before[old][:2]


def test_prefix_exact_template_gives_one_sequence_per_conversation(tmp_path):
    write_data(tmp_path / "data" / "a.jsonl", CONVERSATIONS)
    tok_cfg = {"path": "sample/model", "chat_template": str(TEMPLATES / "chatml_like.jinja")}
    r = Pipeline(tmp_path, tok_cfg, None, tmp_path / "journal").run(
        tmp_path / "data" / "a.jsonl", "x"
    )
    assert r["tok"].column("prefix_exact").to_pylist() == [True] * len(CONVERSATIONS)
    tok = _load(tok_cfg)
    rows = {row["prompt_id"]: row for row in r["tok"].to_pylist()}
    turns = _turns(r["gen"])
    multi = 0
    for pid, ts in turns.items():
        segs = rows[pid]["turn_segments"]
        for k in range(1, len(ts)):
            multi += 1
            (p0, o0), (p1, _) = ts[k - 1], ts[k]
            assert p1 == p0 + o0 + segs[k - 1]
            # ... and it is what the template renders for the model's answers (as text: the
            # ids are the model's own, never re-encoded)
            messages = json.loads(rows[pid]["messages"])
            spans = formats.turn_spans(messages)
            hist = []
            pos = 0
            for j in range(k):
                a, e = spans[j]
                out = ts[j][1]
                hist += messages[pos:a] + [{"role": "assistant", "content": tok.decode(out[:-1])}]
                pos = e
            hist += messages[pos : spans[k][0]]
            text = tok.apply_chat_template(hist, add_generation_prompt=True, tokenize=False)
            assert tok.decode(p1) == text
    assert multi >= 2
    d = r["dataset"].to_pylist()
    assert len(d) == len({x["prompt_id"] for x in d})  # one sample per conversation
    for row in d:
        ts = turns[row["prompt_id"]]
        kept = ts[: sum(1 for _ in ts)]
        ones = sum(len(o) for _, o in kept)
        if row["num_output_tokens"] == ones:  # every turn kept: mask covers each output
            for p, o in kept:
                assert row["loss_mask"][len(p) : len(p) + len(o)] == [1] * len(o)
        assert sum(row["loss_mask"]) == row["num_output_tokens"]
    assert r["dataset_meta"]["tokenmill.conversation_samples"] == str(len(d))


def test_context_option_is_checked_before_any_job(repo_root):
    import copy

    import yaml

    from tokenmill.config import ConfigError, check_config

    base = yaml.safe_load((repo_root / "config.yaml").read_text())
    ok = copy.deepcopy(base)
    ok["categories"]["chat"]["context"] = "regenerated"
    check_config(ok, repo_root)
    bad = copy.deepcopy(base)
    bad["categories"]["chat"]["context"] = "on_policy"
    with pytest.raises(ConfigError, match="context"):
        check_config(bad, repo_root)

"""context: regenerated: every assistant turn regenerated in order on the model's own earlier
turns, token-exact (docs/multi-turn.md). Real CLI runs: prepare -> tokenize -> generate against
the reference engine (`tokenmill serve-reference`, the demo model in sample/model) -> merge;
the tool-call test scripts the answers with tests/fake_sglang.py --script."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import fake_sglang
import pyarrow.parquet as pq
import pytest

from tokenmill import contracts
from tokenmill.generate import journal
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
                 gen: dict | None = None, generate_timeout: float = 180,
                 command: list[str] | None = None):  # fmt: skip
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
        if command is not None:  # another engine (tests/fake_sglang.py)
            self.gen["launch"]["command"] = command
        (tmp / "gen.json").write_text(json.dumps(self.gen))
        (tmp / "tok.json").write_text(json.dumps(tok_cfg))

    def generate_argv(self, tokenized: Path, t: Path) -> list[str]:
        """`tokenmill generate` of the shard `tokenized`, its outputs in `t`."""
        return ["generate", "--generation-config", str(self.tmp / "gen.json"),
                "--tokenizer-config", str(self.tmp / "tok.json"), "--category", "mt",
                "--shard", "000", "--tokenized", str(tokenized),
                "--out", str(t / "g.parquet"), "--rejected", str(t / "r.parquet"),
                "--meta", str(t / "m.json"), "--journal-dir", str(self.journal),
                "--log-dir", str(t / "logs")]  # fmt: skip

    def run(self, data: Path, tag: str) -> dict:
        t = self.tmp / tag
        t.mkdir()
        cat = {"sources": [str(data)], "format": "messages", "context": "regenerated"}
        cli("prepare", "--category", "mt", "--category-config", json.dumps(cat),
            "--out", str(t / "p.parquet"), "--rejected", str(t / "pr.parquet"))  # fmt: skip
        cli("tokenize", "--prompts", str(t / "p.parquet"), "--category", "mt", "--shards", "1",
            "--shard-by", "prompt_id",
            "--tokenizer-config", str(self.tmp / "tok.json"), "--max-prompt-tokens", "2048",
            "--out-dir", str(t / "tok"), "--rejected", str(t / "tr.parquet"),
            "--stop-tokens", json.dumps([STOP]),
            f"--think-end-token={self.think_end or ''}")  # fmt: skip
        cli(*self.generate_argv(t / "tok" / "000.parquet", t), timeout=self.generate_timeout)
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


def check_turn_prompts(r, tok_cfg: dict, think_end: str | None) -> dict:
    """Each turn's prompt is apply_chat_template of the conversation with the model's own earlier
    answers, reconstructed from ids by the token-level split (written out here independently of
    the package); a tool-call turn the conversation went on from keeps the dataset's message.
    Returns the turns by prompt_id."""
    tok = _load(tok_cfg)
    kwargs = tok_cfg.get("chat_template_kwargs") or {}
    stop = tok.convert_tokens_to_ids(STOP)
    think = tok.convert_tokens_to_ids(think_end) if think_end else None
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
            expected = tok.apply_chat_template(
                history, tools=tools, add_generation_prompt=True, tokenize=True,
                return_dict=False, **kwargs,
            )  # fmt: skip
            assert prompt == list(expected), (pid, k)
            ids = output[:-1] if output[-1] == stop else output
            if any(m.get("tool_calls") for m in messages[a:e]):
                # a tool-call turn goes on only when the model's ids are the dataset's call,
                # with the dataset's messages
                assert k == len(ts) - 1 or output == rows[pid]["tool_call_ids"][k], (pid, k)
                history += messages[a:e]
            elif think is not None and think in ids:
                cut = ids.index(think)
                history.append({"role": "assistant", "content": tok.decode(ids[cut + 1 :]),
                                "reasoning_content": tok.decode(ids[:cut])})  # fmt: skip
            else:
                history.append({"role": "assistant", "content": tok.decode(ids)})
            pos = e
    return turns


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3")
    write_data(tmp / "data" / "a.jsonl", CONVERSATIONS)
    tok_cfg = {"path": "sample/model", "chat_template": str(TEMPLATES / "qwen3_like.jinja")}
    pipe = Pipeline(tmp, tok_cfg, "</think>", tmp / "journal")  # thinking on (the default)
    return pipe, pipe.run(tmp / "data" / "a.jsonl", "first")


@pytest.mark.slow  # the real CLI stages, prepare to merge: 10-40 s each
@pytest.mark.parametrize("run", ["kimi_run", "qwen3_run"])
def test_each_turn_prompt_is_the_template_of_the_models_own_answers(run, request):
    pipe, r = request.getfixturevalue(run)
    # Both templates drop earlier reasoning: not prefix-exact, one sample per turn.
    assert r["tok"].column("prefix_exact").to_pylist() == [False] * len(CONVERSATIONS)
    turns = check_turn_prompts(r, pipe.tok_cfg, pipe.think_end)
    assert sum(len(v) for v in turns.values()) > len(CONVERSATIONS)  # later turns were generated
    # The tokenizer the later turns need is loaded in the start-up (inside replay_s), before
    # the first request: the generation window, and the tok/s of the statistics, exclude it.
    timing = r["meta"]["timing"]
    assert 0 < timing["tokenizer_s"] <= timing["replay_s"] <= timing["startup_s"], timing
    # one sample per turn that ended with a stop id (merge drops truncated ones)
    stopped = r["gen"].column("finish_type").to_pylist().count("stop")
    assert r["dataset"].num_rows == stopped
    assert r["dataset_meta"]["tokenmill.turn_samples"] == str(stopped)


def journal_records(journal_dir: Path, gen) -> dict:
    """The journal's record of every generated turn, by sample key (wherever it is stored)."""
    found, _ = journal.load(journal_dir, "mt", gen.column("sample_key").to_pylist())
    assert len(found) == gen.num_rows
    return found


def write_journal(journal_dir: Path, records) -> Path:
    """A journal holding just these records, as one job attempt's JSONL file."""
    (journal_dir / "mt").mkdir(parents=True)
    lines = b"".join(journal.encode_line(rec) for rec in records)
    (journal_dir / "mt" / "000.a.jsonl").write_bytes(lines)
    return journal_dir


GEN_COLUMNS = ["prompt_id", "turn", "sample_key", "turn_prompt_ids", "output_ids",
               "conversation_end"]  # fmt: skip


@pytest.mark.slow  # the real CLI stages, prepare to merge: 10-40 s each
def test_kill_between_turns_resumes_at_the_first_unjournaled_turn(kimi_run, tmp_path):
    pipe, first = kimi_run
    total = first["gen"].num_rows
    assert first["meta"]["journal"]["compaction"]["records"] == total
    recs = journal_records(pipe.journal, first["gen"])
    # A job killed after 2 turns were journaled: the first turns of two conversations.
    firsts = [g["sample_key"] for g in first["gen"].to_pylist() if g["turn"] == 0][:2]
    jdir = write_journal(tmp_path / "journal", [recs[k] for k in firsts])
    resumed = Pipeline(tmp_path, pipe.tok_cfg, pipe.think_end, jdir)
    r = resumed.run(pipe.tmp / "data" / "a.jsonl", "resumed")
    assert r["meta"]["counts"]["requested"] == total - 2
    assert r["meta"]["counts"]["turns_from_journal"] == 2
    assert r["gen"].select(GEN_COLUMNS).equals(first["gen"].select(GEN_COLUMNS))
    # The finished shard's journal is compacted like a plain shard's: one file, every turn...
    compaction = r["meta"]["journal"]["compaction"]
    assert (compaction["records"], compaction["files_deleted"]) == (total, 2)
    assert sorted(p.name for p in (jdir / "mt").glob("000*")) == ["000.parquet"]
    # ... which a rerun reads: nothing asked, nothing to compact, the same output.
    again = resumed.run(pipe.tmp / "data" / "a.jsonl", "again")
    assert again["meta"]["counts"]["requested"] == 0
    assert again["meta"]["counts"]["turns_from_journal"] == total
    assert again["meta"]["journal"]["compaction"] is None
    assert again["gen"].select(GEN_COLUMNS).equals(first["gen"].select(GEN_COLUMNS))


@pytest.mark.slow  # the real CLI stages, prepare to merge: 10-40 s each
def test_sigkill_mid_conversation_resumes_without_asking_a_finished_turn_again(tmp_path):
    """A real kill: the stand-in server answers 3 requests (the conversations' first turns) and
    holds the rest (their second turns, sent because the first ones were journaled); the job is
    SIGKILLed there. The rerun asks only for the turns not journaled, and its output is a clean
    run's."""
    write_data(tmp_path / "data" / "a.jsonl", CONVERSATIONS)
    tok_cfg = {"path": "sample/model", "chat_template": str(TEMPLATES / "chatml_like.jinja")}

    # one command for both runs: the launch command is part of the generation fingerprint
    counter = tmp_path / "requests"
    fake = ["{python}", fake_sglang.FAKE, "--model-path", "{model}", "--skip-tokenizer-init",
            "--host", "{host}", "--port", "{port}", "--output-len", "3",
            "--counter-file", str(counter), "--hold-file", str(tmp_path / "hold")]  # fmt: skip

    (tmp_path / "clean").mkdir()
    clean = Pipeline(tmp_path / "clean", tok_cfg, None, tmp_path / "clean" / "journal",
                     command=fake).run(tmp_path / "data" / "a.jsonl", "x")  # fmt: skip
    total = clean["gen"].num_rows
    assert total == sum(clean["tok"].column("num_turns").to_pylist()) == 7  # none ended early
    (tmp_path / "killed").mkdir()
    pipe = Pipeline(tmp_path / "killed", tok_cfg, None, tmp_path / "killed" / "journal",
                    command=fake)  # fmt: skip
    out = tmp_path / "killed" / "k"
    argv = [sys.executable, "-m", "tokenmill",
            *pipe.generate_argv(clean["dir"] / "tok" / "000.parquet", out)]  # fmt: skip
    (tmp_path / "hold").write_text("3")
    job = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def journaled() -> int:
        return sum(f.read_bytes().count(b"\n") for f in (pipe.journal / "mt").glob("*.jsonl"))

    deadline = time.monotonic() + 120
    while journaled() < 3 or fake_sglang.count_requests(counter) < total + 6:
        assert time.monotonic() < deadline and job.poll() is None, "the job never got there"
        time.sleep(0.05)
    job.kill()
    job.wait(timeout=10)
    assert journaled() == 3  # the first turns; the second turns were in flight, held
    (tmp_path / "hold").unlink()
    asked = fake_sglang.count_requests(counter)
    cli(*pipe.generate_argv(clean["dir"] / "tok" / "000.parquet", out))
    assert fake_sglang.count_requests(counter) - asked == total - 3
    meta = json.loads((out / "m.json").read_text())
    assert meta["counts"]["turns_from_journal"] == 3 and meta["counts"]["requested"] == total - 3
    resumed = pq.read_table(out / "g.parquet")
    assert resumed.select(GEN_COLUMNS).equals(clean["gen"].select(GEN_COLUMNS))


@pytest.mark.slow  # the real CLI stages, prepare to merge: 10-40 s each
def test_a_journaled_refusal_that_does_not_blame_the_prompt_is_asked_again(kimi_run, tmp_path):
    pipe, first = kimi_run
    recs = journal_records(pipe.journal, first["gen"])
    by_conv = _keys_by_conversation(first["gen"])
    (a, b, c) = sorted(by_conv.values())  # three conversations of at least two turns

    def refused(key, message):
        return {"key": key, "status": "rejected", "prompt_id": recs[key]["prompt_id"],
                "message": message}  # fmt: skip

    dup = "Duplicate request ID detected: 0123"  # not the prompt's fault: asked again
    too_long = "Input length (9 tokens) exceeds the maximum allowed length"  # final
    kept = (
        [recs[a[0]], refused(a[1], dup), *(recs[k] for k in a[2:])]  # replay meets the refusal
        + [refused(b[1], dup), *(recs[k] for k in b[2:])]  # turn 1 asked; follow meets it
        + [recs[c[0]], refused(c[1], too_long)]  # the conversation ends there, as journaled
    )
    jdir = write_journal(tmp_path / "journal", kept)
    r = Pipeline(tmp_path, pipe.tok_cfg, pipe.think_end, jdir).run(
        pipe.tmp / "data" / "a.jsonl", "rerun"
    )
    assert r["meta"]["counts"]["requested"] == 3  # a's turn 2, b's turns 1 and 2
    ends = {row["prompt_id"]: row["conversation_end"] for row in r["gen"].to_pylist()}
    pid_c = recs[c[0]]["prompt_id"]
    assert ends[pid_c] == "engine_rejected"
    keep = [g for g in first["gen"].to_pylist() if g["prompt_id"] != pid_c]
    got = [g for g in r["gen"].to_pylist() if g["prompt_id"] != pid_c]
    assert [{k: g[k] for k in GEN_COLUMNS} for g in got] == [
        {k: g[k] for k in GEN_COLUMNS} for g in keep
    ]


def _keys_by_conversation(gen) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for g in sorted(gen.to_pylist(), key=lambda g: (g["prompt_id"], g["turn"])):
        out.setdefault(g["prompt_id"], []).append(g["sample_key"])
    return out


@pytest.mark.slow  # the real CLI stages, prepare to merge: 10-40 s each
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
    # The old turn 3 is no longer asked for: compaction sets it aside, as for a plain shard...
    assert r["meta"]["journal"]["compaction"]["stale_added"] == 1
    # ... and the edit undone finds it there.
    back = again.run(pipe.tmp / "data" / "a.jsonl", "undone")
    assert back["meta"]["counts"]["requested"] == 0
    assert back["gen"].select(GEN_COLUMNS).equals(first["gen"].select(GEN_COLUMNS))


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]


def tool_record(city: str) -> dict:
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": city}}}
    return {"messages": [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": f"Sunny in {city}."},
        {"role": "assistant", "content": f"It is sunny in {city}."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are welcome."},
    ], "tools": TOOLS}  # fmt: skip


@pytest.mark.slow  # the real CLI stages, prepare to merge: 10-40 s each
@pytest.mark.parametrize(("think_end", "exact"), [(None, True), ("</think>", False)])
def test_a_tool_call_turn_goes_on_only_when_the_model_made_the_dataset_call(
    tmp_path, think_end, exact
):
    tok_cfg = {"path": "sample/model", "chat_template": str(TEMPLATES / "qwen3_like.jinja")}
    tok = _load(tok_cfg)
    stop = tok.convert_tokens_to_ids(STOP)
    paris, tools = formats.to_conversation(tool_record("Paris"), "messages")

    def render(messages, generation_prompt):
        return list(tok.apply_chat_template(messages, tools=tools, tokenize=True,
                                            add_generation_prompt=generation_prompt,
                                            return_dict=False))  # fmt: skip

    # The stand-in engine makes the dataset's call in Paris (its ids through the stop id), then
    # answers the tool result with its own words; in Rome it says something else.
    p1, with_call = render(paris[:1], True), render(paris[:2], False)
    rest = with_call[len(p1) :]
    call = rest[: rest.index(stop) + 1]
    answer = tok.encode("Sunny, it says.", add_special_tokens=False) + [stop]
    script = [{"ends_with": p1, "output": call},
              {"ends_with": render(paris[:3], True), "output": answer}]  # fmt: skip
    (tmp_path / "script.json").write_text(json.dumps(script))
    (tmp_path / "data").mkdir()
    with (tmp_path / "data" / "a.jsonl").open("w") as f:
        f.writelines(json.dumps(tool_record(c)) + "\n" for c in ("Paris", "Rome"))
    command = ["{python}", fake_sglang.FAKE, "--model-path", "{model}", "--skip-tokenizer-init",
               "--host", "{host}", "--port", "{port}",
               "--script", str(tmp_path / "script.json")]  # fmt: skip
    r = Pipeline(tmp_path, tok_cfg, think_end, tmp_path / "journal", command=command).run(
        tmp_path / "data" / "a.jsonl", "x"
    )
    assert r["tok"].column("prefix_exact").to_pylist() == [exact, exact]
    turns = check_turn_prompts(r, tok_cfg, think_end)
    ends = {g["prompt_id"]: g["conversation_end"] for g in r["gen"].to_pylist()}
    pid_paris = formats.prompt_id(paris, tools)
    (pid_rome,) = set(ends) - {pid_paris}
    # Paris: the matched call goes on with the dataset's call and tool result, to the end.
    assert [o for _, o in turns[pid_paris][:2]] == [call, answer]
    result = "<tool_response>\nSunny in Paris.\n</tool_response>"
    assert result in tok.decode(turns[pid_paris][1][0])
    assert (len(turns[pid_paris]), ends[pid_paris]) == (3, "complete")
    # Rome: kept as a sample, and the conversation ends at the call the model did not make.
    assert (len(turns[pid_rome]), ends[pid_rome]) == (1, "tool_call_diverged")
    assert r["meta"]["counts"]["conversation_ends"] == {"complete": 1, "tool_call_diverged": 1}


@pytest.mark.slow  # the real CLI stages, prepare to merge: 10-40 s each
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
    # One sample per conversation: its turns up to the first truncated one (merge rejects that
    # and the turns built on it), the last kept turn's prompt + output, loss 1 over every kept
    # turn's output and 0 elsewhere.
    finish = {(g["prompt_id"], g["turn"]): g["finish_type"] for g in r["gen"].to_pylist()}
    expected = {}
    for pid, ts in turns.items():
        n_ok = next((k for k in range(len(ts)) if finish[pid, k] != "stop"), len(ts))
        if n_ok:
            expected[pid] = ts[:n_ok]
    d = {row["prompt_id"]: row for row in r["dataset"].to_pylist()}
    assert r["dataset"].num_rows == len(d) == len(expected) > 0
    assert any(len(kept) > 1 for kept in expected.values())
    for pid, kept in expected.items():
        row = d[pid]
        assert row["input_ids"] == kept[-1][0] + kept[-1][1]
        mask = [0] * len(row["input_ids"])
        for p, o in kept:
            mask[len(p) : len(p) + len(o)] = [1] * len(o)
        assert row["loss_mask"] == mask
        assert row["num_output_tokens"] == sum(len(o) for _, o in kept)
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

"""tokenize stage: exact token ids, rejections, byte-identical and stable shards, fingerprint."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tokenmill import contracts
from tokenmill.prepare import stage as prepare
from tokenmill.prepare.formats import prompt_id
from tokenmill.tokenization import shards
from tokenmill.tokenization import stage as tk
from tokenmill.tokenization.tokenizer import load_tokenizer, tokenizer_fingerprint

REPO = Path(__file__).resolve().parent.parent

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CALL = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}

# Hand-made conversations covering what the sample data may not: system turns, tool calls,
# tool results, unicode, multi-turn.
EXTRA = [
    ([{"role": "user", "content": "What is 2 plus 2?"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "content": '{"temp": 21}'},
        ],
        TOOLS,
    ),
    (
        [
            {"role": "user", "content": "Translate: ça va? 你好"},
            {"role": "assistant", "content": "Fine."},
            {"role": "user", "content": "def add(a, b):\n    return a + b"},
        ],
        None,
    ),
]


def tok_cfg(path, **over) -> dict:
    cfg = {
        "path": str(path),
        "revision": None,
        "trust_remote_code": False,
        "chat_template": None,
        "chat_template_kwargs": {"thinking": True},
    }
    cfg.update(over)
    return cfg


def prompt_rows(convs) -> list[dict]:
    rows = {}
    for i, (messages, tools) in enumerate(convs):
        pid = prompt_id(messages, tools)
        rows[pid] = prepare.prompt_row(pid, f"test:{i}", messages, tools)
    return [rows[p] for p in sorted(rows)]


def write_prompts(path, rows) -> Path:
    table = pa.Table.from_pylist(rows, schema=contracts.PROMPTS)
    contracts.write_table(table, path, contracts.PROMPTS, "prepare")
    return Path(path)


def synthetic_convs(n: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog def add return print json Paris 42"
    words = words.split(" ")
    convs = []
    for i in range(n):
        messages = []
        for _ in range(rng.randint(1, 3)):
            messages.append(
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 30)))}
            )
            messages.append(
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(2, 9)))}
            )
        messages.pop()
        convs.append((messages, TOOLS if i % 4 == 0 else None))
    return convs


@pytest.fixture(scope="module")
def sample_convs():
    """The sample data's prompts, through the real prepare stage, plus the hand-made ones."""
    from tokenmill.prepare.stage import prepare

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    convs = []
    for name, cat in config["categories"].items():
        prompts, _, _ = prepare(name, cat, REPO)
        for row in prompts:
            tools = None if row["tools"] is None else json.loads(row["tools"])
            convs.append((json.loads(row["messages"]), tools))
    assert len(convs) >= 10, "the sample data should give a few prompts per category"
    assert any(tools for _, tools in convs), "the sample data should include tools"
    # As the stage sees them: canonical JSON has sorted keys, and `tojson` keeps dict order.
    return [canonical(m, t) for m, t in convs + EXTRA]


def canonical(messages, tools):
    load = json.loads
    return load(contracts.canonical_json(messages)), load(contracts.canonical_json(tools))


def run_stage(tmp_path, name, rows, cfg, n_shards=4, max_tokens=4096, shard_by="prompt_id", **kw):
    prompts = write_prompts(tmp_path / f"{name}_prompts.parquet", rows)
    out = tmp_path / name
    rejected = tmp_path / f"{name}_rejected.parquet"
    summary = tk.tokenize_category(
        prompts, "C", n_shards, cfg, max_tokens, out, rejected, shard_by=shard_by, **kw
    )
    return out, rejected, summary


def shard_digests(out_dir: Path, n: int) -> list[str]:
    return [
        hashlib.sha256(shards.shard_path(out_dir, i).read_bytes()).hexdigest() for i in range(n)
    ]


def split(result: tk.ChunkResult) -> list[list[int] | None]:
    out, pos = [], 0
    for i, n in enumerate(result.lengths):
        out.append(None if i in result.errors else result.flat[pos : pos + n].tolist())
        pos += int(n)
    return out


# ---------------------------------------------------------------------------------------------


def test_shard_of_is_a_function_of_the_prompt_id():
    pid = "00000000000000ff" + "a" * 16
    assert shards.shard_of(pid, 1) == 0
    assert shards.shard_of(pid, 7) == 255 % 7
    assert shards.shard_of(pid, 7) == shards.shard_of(pid[:16] + "b" * 16, 7)
    assert shards.shard_names(3) == ["000", "001", "002"]
    assert shards.shard_path("x", 12) == Path("x/012.parquet")
    with pytest.raises(ValueError):
        shards.shard_of("not-hex-at-all-xx", 3)
    with pytest.raises(ValueError):
        shards.shard_of(pid, 0)


@pytest.mark.parametrize(
    ("template", "kwargs"),
    [
        ("kimi", {"thinking": True}),
        ("kimi", {"thinking": False}),
        ("qwen3", {"enable_thinking": True}),
        ("qwen3", {"enable_thinking": False}),
    ],
)
def test_rendered_batch_encode_equals_apply_chat_template(
    template, kwargs, sample_convs, tiny_tokenizer_dir, tiny_qwen3_tokenizer_dir
):
    path = tiny_tokenizer_dir if template == "kimi" else tiny_qwen3_tokenizer_dir
    tok = load_tokenizer(tok_cfg(path))
    encoder = tk.Encoder(tok, kwargs)
    assert encoder.fast, "the tiny tokenizer is fast: the batch path must be taken"
    rows = [
        (contracts.canonical_json(m), None if t is None else contracts.canonical_json(t))
        for m, t in sample_convs
    ]
    got = split(encoder.encode(rows))
    expected = [
        tok.apply_chat_template(
            m, tools=t, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
        for m, t in sample_convs
    ]
    assert got == expected


def test_kwargs_that_are_apply_chat_template_arguments_take_the_generic_path(tiny_tokenizer_dir):
    tok = load_tokenizer(tok_cfg(tiny_tokenizer_dir))
    assert tk.Encoder(tok, {"thinking": True}).fast
    assert not tk.Encoder(tok, {"thinking": True, "sanitize_control_tokens": True}).fast
    with pytest.raises(tk.TokenizeError, match="add_generation_prompt"):
        tk.Encoder(tok, {"add_generation_prompt": False})


def _char_tokenizer():
    """A slow (pure Python) tokenizer, as Kimi's tiktoken tokenizer is: one token per char."""
    from transformers import PreTrainedTokenizer

    from tokenmill.testing.tiny_model import KIMI_SPECIAL, THINK_TOKENS, template_text

    class CharTokenizer(PreTrainedTokenizer):
        def __init__(self, **kwargs):
            self._vocab = {chr(i): i for i in range(256)}
            super().__init__(**kwargs)

        @property
        def vocab_size(self):
            return 256

        def get_vocab(self):
            return {**self._vocab, **self.added_tokens_encoder}

        def _tokenize(self, text, **kwargs):
            return list(text.encode("utf-8").decode("latin-1"))

        def _convert_token_to_id(self, token):
            return self._vocab[token]

        def _convert_id_to_token(self, index):
            return chr(index)

    tok = CharTokenizer(eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": KIMI_SPECIAL})
    tok.add_tokens(THINK_TOKENS)
    tok.chat_template = template_text("kimi")
    return tok


def test_slow_tokenizer_takes_the_generic_path(tmp_path, tiny_tokenizer_dir):
    tok = _char_tokenizer()
    assert not tok.is_fast
    assert tk.default_processes(tok, 3) == 3
    encoder = tk.Encoder(tok, {"thinking": True})
    assert not encoder.fast
    rows = prompt_rows(EXTRA)
    # End to end through the stage (the fingerprint reads the tiny dir's files; ids are the
    # char tokenizer's).
    out, rejected, summary = run_stage(tmp_path, "slow", rows, tok_cfg(tiny_tokenizer_dir),
                                       n_shards=2, tokenizer=tok)  # fmt: skip
    assert summary.kept == len(rows) and summary.rejected == 0
    table = pa.concat_tables([pq.read_table(shards.shard_path(out, i)) for i in range(2)])
    by_id = dict(zip(table["prompt_id"].to_pylist(), table["prompt_ids"].to_pylist(), strict=True))
    think = tok.convert_tokens_to_ids("<think>")
    for row in rows:
        messages = json.loads(row["messages"])
        tools = json.loads(row["tools"]) if row["tools"] else None
        expected = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, return_dict=False, thinking=True
        )
        assert by_id[row["prompt_id"]] == expected
        assert expected[-1] == think
        # Characters, not BPE pieces: proves these ids came from the slow tokenizer.
        assert "Paris" not in tok.convert_ids_to_tokens(expected)


def _stage_ids(tmp_path, name, convs, cfg) -> list[list[int]]:
    rows = prompt_rows(convs)
    out, _, summary = run_stage(tmp_path, name, rows, cfg, n_shards=3)
    assert summary.kept == len(rows)
    table = pa.concat_tables([pq.read_table(shards.shard_path(out, i)) for i in range(3)])
    by_id = dict(zip(table["prompt_id"].to_pylist(), table["prompt_ids"].to_pylist(), strict=True))
    return [by_id[r["prompt_id"]] for r in rows]


def test_kimi_thinking_prompt_ends_with_think_token(tmp_path, tiny_tokenizer_dir):
    tok = load_tokenizer(tok_cfg(tiny_tokenizer_dir))
    think = tok.convert_tokens_to_ids("<think>")
    on = _stage_ids(tmp_path, "on", EXTRA, tok_cfg(tiny_tokenizer_dir))
    assert all(ids[-1] == think for ids in on)
    off_cfg = tok_cfg(tiny_tokenizer_dir, chat_template_kwargs={"thinking": False})
    off = _stage_ids(tmp_path, "off", EXTRA, off_cfg)
    middle = tok.convert_tokens_to_ids("<|im_middle|>")
    assert all(ids[-1] == middle for ids in off)
    assert all(a[:-1] == b for a, b in zip(on, off, strict=True))


def test_qwen3_enable_thinking(tmp_path, tiny_qwen3_tokenizer_dir):
    tok = load_tokenizer(tok_cfg(tiny_qwen3_tokenizer_dir))
    off_cfg = tok_cfg(tiny_qwen3_tokenizer_dir, chat_template_kwargs={"enable_thinking": False})
    on_cfg = tok_cfg(tiny_qwen3_tokenizer_dir, chat_template_kwargs={"enable_thinking": True})
    off = _stage_ids(tmp_path, "off", EXTRA, off_cfg)
    on = _stage_ids(tmp_path, "on", EXTRA, on_cfg)
    empty_think = tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    generation_prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for a, b in zip(off, on, strict=True):
        assert a[-len(empty_think) :] == empty_think
        assert tok.decode(a).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert b[-len(generation_prompt) :] == generation_prompt
        assert tok.decode(b).endswith("<|im_start|>assistant\n")
        assert a == b + empty_think


@pytest.mark.parametrize("template", ["kimi", "qwen3"])
def test_tools_are_rendered(tmp_path, template, tiny_tokenizer_dir, tiny_qwen3_tokenizer_dir):
    path = tiny_tokenizer_dir if template == "kimi" else tiny_qwen3_tokenizer_dir
    tok = load_tokenizer(tok_cfg(path))
    convs = [EXTRA[2], (EXTRA[2][0], None)]
    with_tools, without = _stage_ids(tmp_path, template, convs, tok_cfg(path))
    text = tok.decode(with_tools)
    assert "Weather of a city" in text and "get_weather" in text
    assert "Weather of a city" not in tok.decode(without)
    if template == "kimi":
        assert text.startswith("<|im_system|>tool_declare<|im_middle|>")
    else:
        assert "<tools>" in text and "<tool_response>" in text


def test_too_long_prompts_are_rejected_not_truncated(tmp_path, tiny_tokenizer_dir):
    cfg = tok_cfg(tiny_tokenizer_dir)
    tok = load_tokenizer(cfg)
    rows = prompt_rows(synthetic_convs(60))
    lengths = {
        r["prompt_id"]: len(
            tok.apply_chat_template(
                json.loads(r["messages"]),
                tools=json.loads(r["tools"]) if r["tools"] else None,
                add_generation_prompt=True,
                return_dict=False,
                thinking=True,
            )
        )
        for r in rows
    }
    limit = sorted(lengths.values())[len(lengths) // 2]
    too_long = {p for p, n in lengths.items() if n > limit}
    assert 0 < len(too_long) < len(rows)
    out, rejected, summary = run_stage(tmp_path, "long", rows, cfg, n_shards=3, max_tokens=limit)
    rej = pq.read_table(rejected).to_pylist()
    assert {r["prompt_id"] for r in rej} == too_long
    assert all(r["reason"] == "too_long" and r["stage"] == "tokenize" for r in rej)
    for r in rej:
        assert r["detail"] == f"{lengths[r['prompt_id']]} prompt tokens > max_prompt_tokens {limit}"
        assert json.loads(r["record"])["messages"] == json.loads(
            next(x["messages"] for x in rows if x["prompt_id"] == r["prompt_id"])
        )
    assert [r["prompt_id"] for r in rej] == sorted(too_long)
    assert summary.rejected == len(too_long) and summary.kept == len(rows) - len(too_long)
    kept_total = 0
    for i in range(3):
        path = shards.shard_path(out, i)
        table = pq.read_table(path)
        meta = contracts.read_metadata(path)
        ids = table["prompt_id"].to_pylist()
        assert not set(ids) & too_long
        assert table["num_prompt_tokens"].to_pylist() == [lengths[p] for p in ids]
        assert [len(x) for x in table["prompt_ids"].to_pylist()] == [lengths[p] for p in ids]
        in_shard = [p for p in lengths if shards.shard_of(p, 3) == i]
        assert int(meta["tokenmill.records_in"]) == len(in_shard)
        assert int(meta["tokenmill.rejected"]) == len(set(in_shard) & too_long)
        assert int(meta["tokenmill.kept"]) == table.num_rows
        kept_total += table.num_rows
    assert kept_total == summary.kept


def test_bad_records_and_template_errors_are_rejections(tmp_path, tiny_tokenizer_dir):
    template = tmp_path / "strict.jinja"
    template.write_text(
        "{%- for m in messages -%}"
        "{%- if m['content'] == 'explode' -%}{{ raise_exception('cannot render this') }}"
        "{%- endif -%}{{ m['content'] }}{%- endfor -%}"
    )
    cfg = tok_cfg(tiny_tokenizer_dir, chat_template=str(template))
    good = ([{"role": "user", "content": "fine"}], None)
    boom = ([{"role": "user", "content": "explode"}], None)
    empty = ([{"role": "user", "content": ""}], None)
    rows = prompt_rows([good, boom, empty])
    rows.append(
        {"prompt_id": "f" * 32, "source": "test:bad", "messages": "{not json", "tools": None}
    )
    out, rejected, summary = run_stage(tmp_path, "bad", rows, cfg, n_shards=2)
    reasons = {r["prompt_id"]: r for r in pq.read_table(rejected).to_pylist()}
    assert reasons[prompt_id(*boom)]["reason"] == "template_error"
    assert "cannot render this" in reasons[prompt_id(*boom)]["detail"]
    assert reasons[prompt_id(*empty)]["reason"] == "empty_prompt"
    assert reasons["f" * 32]["reason"] == "invalid_record"
    assert reasons["f" * 32]["record"] == contracts.canonical_json(
        {"messages": "{not json", "tools": None}
    )
    assert summary.kept == 1 and summary.rejected == 3 and summary.records_in == 4
    kept = pa.concat_tables([pq.read_table(shards.shard_path(out, i)) for i in range(2)])
    assert kept["prompt_id"].to_pylist() == [prompt_id(*good)]


def test_unsorted_prompts_fail_and_duplicates_are_rejected(tmp_path, tiny_tokenizer_dir):
    rows = prompt_rows(EXTRA)
    cfg = tok_cfg(tiny_tokenizer_dir)
    with pytest.raises(tk.TokenizeError, match="not sorted"):
        run_stage(tmp_path, "unsorted", rows[::-1], cfg)
    # A failed run leaves nothing that looks like output: no shards, no rejected file, no spill.
    assert list((tmp_path / "unsorted").iterdir()) == []
    assert not (tmp_path / "unsorted_rejected.parquet").exists()
    dup = rows[:2] + [dict(rows[1], source="test:again")] + rows[2:]
    _, rejected, summary = run_stage(tmp_path, "dup", dup, cfg)
    rej = pq.read_table(rejected).to_pylist()
    assert [(r["reason"], r["source"]) for r in rej] == [("duplicate_prompt_id", "test:again")]
    assert summary.kept == len(rows)


def test_reruns_are_byte_identical_and_every_shard_is_written(tmp_path, tiny_tokenizer_dir):
    rows = prompt_rows(synthetic_convs(40))
    cfg = tok_cfg(tiny_tokenizer_dir)
    n = 64  # more shards than prompts: some shards are empty
    a, rej_a, _ = run_stage(tmp_path, "a", rows, cfg, n_shards=n, max_tokens=90)
    b, rej_b, _ = run_stage(tmp_path, "b", rows, cfg, n_shards=n, max_tokens=90, chunk_rows=7)
    assert sorted(p.name for p in a.iterdir()) == [f"{s}.parquet" for s in shards.shard_names(n)]
    assert shard_digests(a, n) == shard_digests(b, n)
    assert rej_a.read_bytes() == rej_b.read_bytes()
    assert 0 < pq.read_table(rej_a).num_rows < len(rows), "the limit should reject some"
    used = {shards.shard_of(r["prompt_id"], n) for r in rows}
    empty = sorted(set(range(n)) - used)
    assert empty, "with 64 shards for 40 prompts some shards must be empty"
    path = shards.shard_path(a, empty[0])
    assert pq.read_table(path).num_rows == 0
    meta = contracts.read_metadata(path)
    assert meta["tokenmill.records_in"] == "0" and meta["tokenmill.shard"] == f"{empty[0]:03d}"
    fingerprint, _ = tokenizer_fingerprint(cfg)
    for i in range(n):
        path = shards.shard_path(a, i)
        meta = contracts.read_metadata(path)
        assert meta["tokenmill.tokenizer_fingerprint"] == fingerprint
        assert meta["tokenmill.category"] == "C" and meta["tokenmill.stage"] == "tokenize"
        assert pq.read_schema(path).remove_metadata() == contracts.TOKENIZED
        ids = pq.read_table(path)["prompt_id"].to_pylist()
        assert ids == sorted(ids) and all(shards.shard_of(p, n) == i for p in ids)
    assert not list(a.glob(".*")), "no spill files are left behind"


def _edit_into(rows, n, same_shard: bool):
    """Replace one prompt's messages; the new prompt_id lands in the old shard (or not)."""
    old = rows[5]
    messages = json.loads(old["messages"])
    for k in range(1000):
        new_messages = messages[:-1] + [dict(messages[-1], content=f"edited {k}")]
        pid = prompt_id(new_messages, None if old["tools"] is None else json.loads(old["tools"]))
        if (shards.shard_of(pid, n) == shards.shard_of(old["prompt_id"], n)) == same_shard:
            break
    new = dict(old, prompt_id=pid, messages=contracts.canonical_json(new_messages))
    return sorted(rows[:5] + rows[6:] + [new], key=lambda r: r["prompt_id"]), old, new


@pytest.mark.parametrize("same_shard", [True, False])
def test_editing_one_prompt_changes_only_its_shards(
    tmp_path, monkeypatch, tiny_tokenizer_dir, same_shard
):
    # Small row groups and chunks: the edit shifts chunk boundaries and row-group cuts, which
    # must not leak into other shards.
    monkeypatch.setattr(contracts, "ROW_GROUP_TOKENS", 400)
    n = 5
    rows = prompt_rows(synthetic_convs(120, seed=1))
    edited, old, new = _edit_into(rows, n, same_shard)
    cfg = tok_cfg(tiny_tokenizer_dir)
    a, _, _ = run_stage(tmp_path, "before", rows, cfg, n_shards=n, chunk_rows=16)
    assert any(pq.ParquetFile(shards.shard_path(a, i)).num_row_groups > 1 for i in range(n))
    b, _, _ = run_stage(tmp_path, "after", edited, cfg, n_shards=n, chunk_rows=16)
    before, after = shard_digests(a, n), shard_digests(b, n)
    changed = {i for i in range(n) if before[i] != after[i]}
    expected = {shards.shard_of(old["prompt_id"], n), shards.shard_of(new["prompt_id"], n)}
    # Same shard: exactly that one file differs. Different shards: exactly those two differ.
    assert len(expected) == (1 if same_shard else 2)
    assert changed == expected


def test_workers_give_the_same_bytes(tmp_path, tiny_tokenizer_dir):
    rows = prompt_rows(synthetic_convs(50))
    cfg = tok_cfg(tiny_tokenizer_dir)
    a, rej_a, _ = run_stage(tmp_path, "one", rows, cfg, max_tokens=300, chunk_rows=10)
    b, rej_b, s = run_stage(tmp_path, "two", rows, cfg, max_tokens=300, chunk_rows=10, workers=2)
    assert s.kept + s.rejected == len(rows)
    assert shard_digests(a, 4) == shard_digests(b, 4)
    assert rej_a.read_bytes() == rej_b.read_bytes()


def test_fingerprint_changes_with_template_and_kwargs_only(tmp_path, tiny_tokenizer_dir):
    base_cfg = tok_cfg(tiny_tokenizer_dir)
    base, files = tokenizer_fingerprint(base_cfg)
    names = [f["name"] for f in files]
    assert "tokenizer.json" in names and "chat_template.jinja" in names
    tj = tiny_tokenizer_dir / "tokenizer.json"
    assert {"name": "tokenizer.json", "size": tj.stat().st_size,
            "sha256": hashlib.sha256(tj.read_bytes()).hexdigest()} in files  # fmt: skip

    # Not otherwise: reloading, another location, weights, the same template given explicitly.
    assert tokenizer_fingerprint(base_cfg)[0] == base
    copy = tmp_path / "copy"
    shutil.copytree(tiny_tokenizer_dir, copy)
    (copy / "model.safetensors").write_bytes(b"weights do not count")
    (copy / ".cache").mkdir()
    (copy / ".cache" / "x.lock").write_text("hub download bookkeeping")
    assert tokenizer_fingerprint(tok_cfg(copy))[0] == base
    same_template = tmp_path / "same.jinja"
    same_template.write_text((tiny_tokenizer_dir / "chat_template.jinja").read_text())
    # The tokenizer's own template, given as an override: the effective template is unchanged.
    assert tokenizer_fingerprint(tok_cfg(copy, chat_template=str(same_template)))[0] == base

    # Changes: kwargs, the template, tokenizer files, revision, remote code.
    changed = {
        tokenizer_fingerprint(tok_cfg(copy, chat_template_kwargs={"thinking": False}))[0],
        tokenizer_fingerprint(tok_cfg(copy, chat_template_kwargs={}))[0],
    }
    other_template = tmp_path / "other.jinja"
    other_template.write_text(same_template.read_text() + "\n")
    changed.add(tokenizer_fingerprint(tok_cfg(copy, chat_template=str(other_template)))[0])
    changed.add(tokenizer_fingerprint(tok_cfg(copy, revision="v2"))[0])
    changed.add(tokenizer_fingerprint(tok_cfg(copy, trust_remote_code=True))[0])
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["model_max_length"] = 8192
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    changed.add(tokenizer_fingerprint(tok_cfg(copy))[0])
    assert base not in changed and len(changed) == 6


def test_cli(tmp_path, tiny_tokenizer_dir, capsys):
    rows = prompt_rows(EXTRA)
    prompts = write_prompts(tmp_path / "prompts.parquet", rows)
    cfg_file = tmp_path / "tok.json"
    cfg_file.write_text(json.dumps(tok_cfg(tiny_tokenizer_dir)))
    args = ["--prompts", str(prompts), "--category", "chat", "--shards", "2",
            "--shard-by", "prompt_id",
            "--max-prompt-tokens", "4096", "--rejected", str(tmp_path / "rej.parquet")]  # fmt: skip
    assert (
        tk.main([*args, "--tokenizer-config", str(cfg_file), "--out-dir", str(tmp_path / "a")]) == 0
    )
    inline = json.dumps(tok_cfg(tiny_tokenizer_dir))
    assert tk.main([*args, "--tokenizer-config", inline, "--out-dir", str(tmp_path / "b")]) == 0
    assert shard_digests(tmp_path / "a", 2) == shard_digests(tmp_path / "b", 2)
    assert f"{len(rows)} prompts in, {len(rows)} kept, 0 rejected" in capsys.readouterr().out
    bad = write_prompts(tmp_path / "unsorted.parquet", rows[::-1])
    argv = [*args, "--tokenizer-config", inline, "--out-dir", str(tmp_path / "c")]
    argv[argv.index(str(prompts))] = str(bad)
    assert tk.main(argv) == 1
    assert "not sorted by prompt_id" in capsys.readouterr().err


def test_a_hub_id_missing_from_the_cache_is_a_clear_error(tmp_path):
    from tokenmill.tokenization.tokenizer import tokenizer_dir

    with pytest.raises(FileNotFoundError, match="no-such-org/no-such-model"):
        tokenizer_dir(tok_cfg("no-such-org/no-such-model"), tmp_path)


def _system_prompt_convs(groups: int, per_group: int):
    """Prompts in `groups` families, each opening with its own long system prompt."""
    convs = []
    for g in range(groups):
        system = f"family {g}: " + " ".join(f"rule{g}x{k} is binding." for k in range(40))
        for i in range(per_group):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {i} of family {g}"},
            ]
            convs.append((messages, None))
    return convs


def test_shard_by_prefix_keeps_families_together_and_writes_the_assignment(
    tmp_path, tiny_tokenizer_dir
):
    rows = prompt_rows(_system_prompt_convs(groups=8, per_group=25))
    rows.append(rows[0] | {"prompt_id": "not-hex"})  # a rejected row keeps its hash shard
    rows.sort(key=lambda r: r["prompt_id"])
    cfg = tok_cfg(tiny_tokenizer_dir)
    n = 4
    by_id, _, _ = run_stage(tmp_path, "by_id", rows, cfg, n_shards=n, shard_by="prompt_id")
    a, rej, summary = run_stage(tmp_path, "a", rows, cfg, n_shards=n, shard_by="prefix")
    b, _, _ = run_stage(tmp_path, "b", rows, cfg, n_shards=n, shard_by="prefix", chunk_rows=7)
    assert shard_digests(a, n) == shard_digests(b, n), "deterministic, whatever the chunks"
    assert summary.kept == 200 and summary.rejected == 1

    def table(out):
        return {
            r["prompt_id"]: r["prompt_ids"]
            for i in range(n)
            for r in pq.read_table(shards.shard_path(out, i)).to_pylist()
        }

    assert table(a) == table(by_id), "the same rows and ids, only placed elsewhere"
    family_shards: dict[str, set] = {}
    digests = set()
    for i in range(n):
        path = shards.shard_path(a, i)
        t = pq.read_table(path)
        meta = contracts.read_metadata(path)
        assert meta[contracts.META_SHARD_BY] == "prefix"
        digests.add(meta[contracts.META_ASSIGNMENT])
        ids = t["prompt_id"].to_pylist()
        assert ids == sorted(ids)
        assert abs(t.num_rows - 50) <= 5, "within 10 % of the mean"
        assert int(meta["tokenmill.records_in"]) == t.num_rows  # "not-hex" has no shard
        for prompt in t["prompt_ids"].to_pylist():
            family_shards.setdefault(tuple(prompt[:40]), set()).add(i)
    assert len(family_shards) == 8
    assert sum(len(s) for s in family_shards.values()) <= 8 + n - 1, family_shards
    # The digest written by tokenize is the one read back from the shards' prompt ids.
    (digest,) = digests
    assert shards.Assignment(a, n).digest == digest
    assert shards.assignment_of(shards.shard_path(a, 0), meta, n).digest == digest
    assert pq.read_table(rej).column("reason").to_pylist() == [tk.INVALID_PROMPT_ID]
    assert shards.assignment_of(shards.shard_path(by_id, 0), {}, n) is None

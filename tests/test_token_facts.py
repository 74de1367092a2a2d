"""The token facts (validate.TokenFacts, results/tokenizer/token_facts.json): the `token_facts`
rule loads the tokenizer once and merge, stats and draft-vocab read its file instead of loading
one; the Rules built from the file are the Rules built from the loaded tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_merge import (
    DS_CFG,
    GEN_CFG,
    build_tokenizer,
    gen_row,
    write_generated,
    write_tokenized,
)

from tokenmill.dataset import merge, stats, validate
from tokenmill.settings import load_section
from tokenmill.tokenization.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def write_facts(out: Path, ds, gen, tok_cfg, basedir=".") -> validate.TokenFacts:
    """`tokenmill token-facts` as the rule runs it; the facts read back."""
    argv = ["--dataset-config", json.dumps(ds), "--generation-config", json.dumps(gen)]
    argv += ["--tokenizer-config", json.dumps(tok_cfg), "--basedir", str(basedir)]
    assert validate.main([*argv, "--out", str(out)]) == 0
    return validate.read_token_facts(out, ds, gen)


def no_think_open_tokenizer(directory: Path) -> dict:
    """A tokenizer with </think> but no <think> token (it splits into <, think, >)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<eos>", "<|im_end|>", "</think>", "w0", "w1", "<", "think", ">"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<eos>",
        additional_special_tokens=["<|im_end|>", "</think>"],
    )
    fast.save_pretrained(str(directory))
    return {"path": str(directory)}


def test_facts_of_the_demo_model_are_its_rules(tmp_path):
    """sample/model as config.yaml sets it up: vocab 720, <|im_end|> and eos, <think></think>."""
    config = load_section(str(ROOT / "config.yaml"), None)
    ds, gen = config.dataset.raw, config.generation.raw
    facts = write_facts(tmp_path / "f.json", ds, gen, config.tokenizer.raw, ROOT)
    tokenizer = load_tokenizer(config.tokenizer, ROOT)
    want = validate.rules_from_config(ds, gen, tokenizer)
    assert validate.rules_from_facts(ds, facts) == want
    assert facts.vocab_size == len(tokenizer) and facts.think_start_id is not None
    assert facts.stop_ids[-1] == tokenizer.eos_token_id
    # the same facts, the same bytes
    first = (tmp_path / "f.json").read_bytes()
    write_facts(tmp_path / "f.json", ds, gen, config.tokenizer.raw, ROOT)
    assert (tmp_path / "f.json").read_bytes() == first
    assert json.loads(first)["tokenizer_fingerprint"]


def test_facts_of_a_tokenizer_without_think_open(tmp_path):
    tok_cfg = no_think_open_tokenizer(tmp_path / "tok")
    ds = {"think_end_token": "</think>"}
    facts = write_facts(tmp_path / "f.json", ds, GEN_CFG, tok_cfg)
    want = validate.rules_from_config(ds, GEN_CFG, load_tokenizer(tok_cfg))
    assert validate.rules_from_facts(ds, facts) == want
    assert (facts.think_start_id, facts.think_end_id) == (None, 3)
    assert facts.stop_ids == (2, 1)
    think = stats.ThinkTokens(ds, {"path": "not/loaded"}, facts=str(tmp_path / "f.json"))
    assert think.get() == (None, 3)
    # an explicit think-start that is not one token fails the command, naming it
    argv = ["--dataset-config", json.dumps(dict(ds, think_start_token="<think>"))]
    argv += ["--generation-config", json.dumps(GEN_CFG), "--tokenizer-config", json.dumps(tok_cfg)]
    assert validate.main([*argv, "--out", str(tmp_path / "g.json")]) == 1
    assert not (tmp_path / "g.json").exists()


def test_facts_of_another_config_are_refused(tmp_path, capsys):
    tok_cfg = no_think_open_tokenizer(tmp_path / "tok")
    path = tmp_path / "f.json"
    write_facts(path, {"think_end_token": "</think>"}, GEN_CFG, tok_cfg)
    with pytest.raises(ValueError, match="think_end_token"):
        validate.read_token_facts(path, {"think_end_token": None}, GEN_CFG)
    with pytest.raises(ValueError, match="stop_tokens"):
        validate.read_token_facts(path, None, dict(GEN_CFG, stop_tokens=["<eos>"]))
    argv = ["--category", "c", "--shard", "000", "--tokenized", "t", "--generated", "g"]
    argv += ["--out", "o", "--rejected", "r", "--dataset-config", json.dumps(DS_CFG)]
    argv += ["--generation-config", json.dumps(dict(GEN_CFG, stop_tokens=["<eos>"]))]
    assert merge.main([*argv, "--token-facts", str(path)]) == 1
    assert "stop_tokens" in capsys.readouterr().err


def fingerprint_of(facts: Path) -> str:
    return json.loads(facts.read_text())["tokenizer_fingerprint"]


def merge_argv(tmp_path: Path, out: str, tokenizer_fp: str) -> list[str]:
    """A merge of a small shard tokenized with the tokenizer of fingerprint `tokenizer_fp`."""
    prompts = {"a": [7, 3], "b": [5, 6, 3], "c": [9]}
    gens = [
        gen_row("a", prompts["a"], [3, 11, 4, 12, 2]),
        gen_row("b", prompts["b"], [8, 4, 9]),
        gen_row("c", prompts["c"], [3, 10, 1]),
    ]
    write_tokenized(tmp_path / "t.parquet", prompts, tokenizer_fp=tokenizer_fp)
    write_generated(tmp_path / "g.parquet", gens)
    return [
        "--category", "chat", "--shard", "000",
        "--tokenized", str(tmp_path / "t.parquet"), "--generated", str(tmp_path / "g.parquet"),
        "--out", str(tmp_path / out / "d.parquet"), "--rejected", str(tmp_path / out / "r.parquet"),
        "--counts-out", str(tmp_path / out / "c.parquet"),
        "--dataset-config", json.dumps(DS_CFG), "--generation-config", json.dumps(GEN_CFG),
    ]  # fmt: skip


def test_merge_from_facts_writes_the_bytes_of_merge_from_the_tokenizer(tmp_path):
    tok_cfg = {"path": str(build_tokenizer(tmp_path / "tok"))}
    write_facts(tmp_path / "f.json", DS_CFG, GEN_CFG, tok_cfg)
    fp = fingerprint_of(tmp_path / "f.json")
    old, new = merge_argv(tmp_path, "old", fp), merge_argv(tmp_path, "new", fp)
    assert merge.main([*old, "--tokenizer-config", json.dumps(tok_cfg)]) == 0
    assert merge.main([*new, "--token-facts", str(tmp_path / "f.json")]) == 0
    for name in ("d.parquet", "r.parquet", "c.parquet"):
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes()
    assert pq.read_table(tmp_path / "new" / "r.parquet").column("reason").to_pylist() == [
        "missing_stop_token"
    ]


def test_facts_of_another_tokenizer_stop_a_hand_run_merge_and_stats_in_one_line(tmp_path, capsys):
    """Snakemake reruns token-facts when the tokenizer changes; a merge or stats run by hand
    with the facts of another tokenizer (or config) must stop, saying so in one line, and
    write nothing: the facts' stop and think ids would be another tokenizer's."""
    tok_cfg = {"path": str(build_tokenizer(tmp_path / "tok"))}
    other_cfg = no_think_open_tokenizer(tmp_path / "other")
    write_facts(tmp_path / "f.json", DS_CFG, GEN_CFG, tok_cfg)
    write_facts(tmp_path / "other.json", DS_CFG, GEN_CFG, other_cfg)
    fp, other_fp = fingerprint_of(tmp_path / "f.json"), fingerprint_of(tmp_path / "other.json")
    assert fp != other_fp

    argv = [*merge_argv(tmp_path, "out", fp), "--token-facts", str(tmp_path / "other.json")]
    capsys.readouterr()  # token-facts' own output
    assert merge.main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert other_fp[:12] in err and fp[:12] in err and "token-facts" in err, err
    assert not (tmp_path / "out").exists()
    # the shard's own tokenizer's facts merge it
    argv = [*merge_argv(tmp_path, "out", fp), "--token-facts", str(tmp_path / "f.json")]
    assert merge.main(argv) == 0

    # stats with facts resolved for another think-end token: one line, no traceback, no files
    from test_stats import CONFIG, build_results

    results = build_results(tmp_path / "tree")
    ds = dict(CONFIG["dataset"], think_end_token="<|im_end|>")
    config = json.dumps(dict(CONFIG, dataset=ds))
    argv = ["--results-dir", str(results), "--config-json", config, "--basedir", str(tmp_path)]
    argv += ["--token-facts", str(tmp_path / "f.json"), "--out-dir", str(tmp_path / "stats")]
    capsys.readouterr()
    assert stats.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenmill stats: token facts") and "think_end_token" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "stats").exists()


def test_merge_from_facts_imports_neither_torch_nor_transformers(tmp_path):
    """The point of the facts file: a merge job does not pay for importing them."""
    tok_cfg = {"path": str(build_tokenizer(tmp_path / "tok"))}
    write_facts(tmp_path / "f.json", DS_CFG, GEN_CFG, tok_cfg)
    fp = fingerprint_of(tmp_path / "f.json")
    argv = [*merge_argv(tmp_path, "new", fp), "--token-facts", str(tmp_path / "f.json")]
    code = (
        "import sys, json; from tokenmill.cli import main; rc = main(json.loads(sys.argv[1]));"
        "print(json.dumps([rc, sorted({m.split('.')[0] for m in sys.modules} &"
        " {'torch', 'transformers', 'tokenizers'})]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(["merge", *argv])],
        capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(ROOT / "workflow"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert json.loads(out.stdout.splitlines()[-1]) == [0, []]


def test_draft_vocab_and_stats_from_facts_write_what_they_wrote_from_the_tokenizer(tmp_path):
    """draft-vocab from-config (the forced stop ids) and stats give the same files from
    --token-facts as from --tokenizer-config. (This small tree has no output without a
    think-close, so stats never asks for the think ids here: ThinkTokens.of below does.)"""
    pytest.importorskip("torch")  # vocab_mapping.pt
    from test_stats import CONFIG, build_results

    from tokenmill.dataset import draft_vocab

    results = build_results(tmp_path)
    build_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"vocab_size": 32}))
    ds = dict(CONFIG["dataset"], draft_vocab_force_stop_ids=True)
    gen = dict(GEN_CFG, model="tok")
    facts = tmp_path / "facts.json"
    write_facts(facts, ds, gen, CONFIG["tokenizer"], tmp_path)
    common = ["--dataset-config", json.dumps(ds), "--generation-config", json.dumps(gen)]
    common += ["--basedir", str(tmp_path), "--counts", str(results / "token_counts")]
    ways = {
        "tokenizer": ["--tokenizer-config", json.dumps(CONFIG["tokenizer"])],
        "facts": ["--token-facts", str(facts)],
    }
    files = {}
    for way, args in ways.items():
        out = tmp_path / way
        assert draft_vocab.main(["from-config", *common, *args, "--out-dir", str(out)]) == 0
        config = json.dumps(dict(CONFIG, dataset=ds, generation=gen))
        argv = ["--results-dir", str(results), "--config-json", config, "--basedir", str(tmp_path)]
        if way == "facts":
            argv += ["--token-facts", str(facts)]
        assert stats.main([*argv, "--out-dir", str(out / "stats")]) == 0
        files[way] = {
            p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()
        }
    assert "t2d-3.npy" in files["facts"] and "stats/summary.json" in files["facts"]
    assert files["facts"] == files["tokenizer"]
    summary = json.loads((tmp_path / "facts" / "vocab_mapping.json").read_text())
    assert summary["always_include_ids"] == [1, 2]  # eos, <|im_end|>
    unloadable = dict(CONFIG, dataset=ds, generation=gen, tokenizer={"path": "nowhere"})
    assert stats.ThinkTokens.of(unloadable, str(tmp_path), str(facts)).get() == (3, 4)

"""Launch flags: only those that can change a token change the generation fingerprint
(tokenmill/launch_flags.py), and a change says what it invalidates before it is paid for.

- the table: every flag in one group, operational ones dropped with their values (`--flag v`,
  `--flag=v`, switches), unknown flags kept, user-declared operational flags dropped;
- a command with only flags excluded before the table existed hashes as it always did;
- docs/engines.md shows the same table;
- end to end (the demo on the reference engine): adding operational flags to the launch command
  of a finished run plans nothing and a forced generate job sends 0 requests; changing --dtype
  makes `tokenmill plan` and the generate job say which key changed and how many journaled
  samples no longer match.
"""

from __future__ import annotations

import hashlib
import json
import subprocess

import pyarrow.parquet as pq
import pytest
import yaml
from helpers import BIN, ROOT, copy_workflow, failed, snakemake

from tokenmill import keys, launch_flags
from tokenmill.contracts import canonical_json
from tokenmill.settings import load_section

BASE = ["{python}", "-m", "tokenmill", "serve-reference", "--model-path", "{model}"]


def gen(command, **launch) -> dict:
    return {"model": "sample/model", "launch": {"command": command, **launch}}


def test_every_flag_has_one_kind_and_one_reason():
    seen = {}
    for group in launch_flags.FLAGS:
        assert group.kind in (launch_flags.OPERATIONAL, launch_flags.TOKEN_AFFECTING)
        assert group.reason
        for flag, n in group.flags.items():
            assert flag.startswith("--") and n in (0, 1), flag
            assert flag not in seen, f"{flag} in two groups"
            seen[flag] = group.kind
    for flag in ("--log-requests", "--mem-fraction-static", "--max-running-requests",
                 "--log-requests-level", "--decode-log-interval", "--show-time-cost",
                 "--dist-timeout", "--watchdog-timeout", "--api-key", "--port"):  # fmt: skip
        assert launch_flags.kind_of(flag) == launch_flags.OPERATIONAL, flag
    for flag in ("--dtype", "--kv-cache-dtype", "--quantization", "--tp", "--random-seed",
                 "--enable-deterministic-inference", "--chunked-prefill-size"):  # fmt: skip
        assert launch_flags.kind_of(flag) == launch_flags.TOKEN_AFFECTING, flag
    assert launch_flags.kind_of("--no-such-flag") == launch_flags.TOKEN_AFFECTING


def test_operational_flags_go_with_their_values_and_the_rest_stays_in_order():
    cmd = [*BASE, "--log-requests", "--dtype", "bfloat16", "--mem-fraction-static", "0.8",
           "--max-running-requests=8", "--log-requests-level", "2", "--show-time-cost",
           "--unknown", "x", "--tp", "2", "--port", "{port}"]  # fmt: skip
    assert launch_flags.token_affecting_args(cmd) == [
        *BASE, "--dtype", "bfloat16", "--unknown", "x", "--tp", "2"
    ]  # fmt: skip
    # user-declared: with a value, with =value, or a switch before another flag
    cmd = [*BASE, "--mine", "3", "--dtype", "half", "--mine=4", "--sw", "--tp", "2"]
    assert launch_flags.token_affecting_args(cmd, ["--mine", "--sw"]) == [
        *BASE, "--dtype", "half", "--tp", "2"
    ]  # fmt: skip
    assert launch_flags.token_affecting_args([*BASE, "--sw"], ["--sw"]) == BASE


def test_operational_flags_do_not_change_the_fingerprint_and_token_flags_do():
    base = keys.generation_fingerprint(gen(BASE))
    ops = [*BASE, "--log-requests", "--mem-fraction-static", "0.8", "--max-running-requests",
           "8", "--decode-log-interval", "40", "--dist-timeout=600"]  # fmt: skip
    assert keys.generation_fingerprint(gen(ops)) == base
    assert keys.generation_fingerprint(gen([*BASE, "--dtype", "float16"])) != base
    assert keys.generation_fingerprint(gen([*BASE, "--my-flag", "1"])) != base  # unknown
    declared = gen([*BASE, "--my-flag", "1"], operational_flags=["--my-flag"])
    assert keys.generation_fingerprint(declared) == base
    # the declaration itself is operational
    assert keys.generation_fingerprint(gen(BASE, operational_flags=["--x"])) == base


def test_fingerprint_of_a_command_with_only_flags_excluded_before_is_unchanged():
    """The material as keys.py hashed it before launch_flags.py existed (its exclusion map
    inlined here): byte-identical fingerprints, so no journal is invalidated."""
    old = {"--host": 1, "--port": 1, "--log-level": 1, "--enable-metrics": 0,
           "--watchdog-timeout": 1, "--api-key": 1, "--admin-api-key": 1}  # fmt: skip

    def before(command):
        out, skip = [], 0
        for arg in command:
            if skip:
                skip -= 1
                continue
            flag = arg.split("=", 1)[0]
            if flag in old:
                skip = 0 if "=" in arg else old[flag]
                continue
            out.append(arg)
        return out

    cmd = [*BASE, "--skip-tokenizer-init", "--host", "{host}", "--port", "{port}", "--tp", "8",
           "--log-level=info", "--enable-metrics", "--watchdog-timeout", "600", "--api-key",
           "k", "--admin-api-key=a", "--dtype", "bfloat16"]  # fmt: skip
    g = load_section(gen(cmd), "generation")
    material = {
        "engine": g.engine,
        "model": g.model,
        "revision": g.revision,
        "sampling": g.raw["sampling"],
        "stop_tokens": g.raw["stop_tokens"],
        "seed_policy": g.seed_policy,
        "launch": before(cmd),
    }
    expected = hashlib.sha256(canonical_json(material).encode()).hexdigest()
    assert keys.generation_fingerprint(g) == expected


def test_material_changes_name_the_key_and_the_flag():
    a = keys.generation_material(gen([*BASE, "--dtype", "float16", "--tp", "2"]))
    b = keys.generation_material(gen([*BASE, "--dtype", "bfloat16", "--tp", "2"]))
    assert keys.material_changes(a, b) == [
        "generation.launch.command: --dtype float16 -> --dtype bfloat16"
    ]
    c = dict(b, sampling=dict(b["sampling"], temperature=0.5))
    assert keys.material_changes(b, c)[0].startswith("generation.sampling: ")


def test_docs_show_the_table():
    text = (ROOT / "docs" / "engines.md").read_text()
    assert launch_flags.markdown_table() in text, (
        "docs/engines.md: paste launch_flags.markdown_table() under 'Launch flags and the "
        "fingerprint'"
    )


# ------------------------------------------------------------------ end to end (the demo)


def planned_jobs(log: str) -> list[str]:
    return [
        line.strip()
        for line in log.splitlines()
        if line.strip().startswith(("rule ", "localrule ", "checkpoint "))
    ]


@pytest.mark.e2e
@pytest.mark.slow
def test_operational_flags_rerun_nothing_and_a_dtype_change_says_what_it_costs(tmp_path):
    wd = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    # One category is enough to see what a flag costs: the other four would only repeat it.
    config["categories"] = {"code": config["categories"]["code"]}
    command = config["generation"]["launch"]["command"]
    command += ["--dtype", "float16"]
    (wd / "config.yaml").write_text(yaml.safe_dump(config))
    run = snakemake(wd)
    assert run.returncode == 0, failed(run)

    # Debug logging and smaller batches after an out-of-memory kill: nothing to do.
    command += ["--log-requests", "--mem-fraction-static", "0.8", "--max-running-requests",
                "8", "--log-requests-level=2", "--decode-log-interval", "40",
                "--show-time-cost", "--dist-timeout", "600"]  # fmt: skip
    (wd / "ops.yaml").write_text(yaml.safe_dump(config))
    dry = snakemake(wd, "-n", "--configfile", "ops.yaml")
    assert dry.returncode == 0, dry.stdout[-4000:] + dry.stderr[-4000:]
    assert planned_jobs(dry.stdout + dry.stderr) == [], dry.stdout[-4000:]
    # A forced rerun of one shard's generate job with these flags sends nothing.
    target = "results/generated/code/000.parquet"
    forced = snakemake(wd, "--configfile", "ops.yaml", "--force", target)
    assert forced.returncode == 0, failed(forced)
    meta = json.loads((wd / "results/generated/code/000.meta.json").read_text())
    assert meta["counts"]["requested"] == 0, meta["counts"]
    assert "fingerprint_change" not in meta

    # A token-affecting flag: the plan and the job say what it invalidates.
    journaled = pq.ParquetFile(wd / "journal/code/000.parquet").metadata.num_rows
    assert journaled > 0
    command[command.index("float16")] = "bfloat16"
    (wd / "dtype.yaml").write_text(yaml.safe_dump(config))
    said = (
        "generation fingerprint changed (generation.launch.command: --dtype float16 -> "
        f"--dtype bfloat16): {journaled} journaled samples of shard 000 no longer match"
    )
    plan = subprocess.run(
        [str(BIN / "tokenmill"), "plan", "--configfile", "dtype.yaml"],
        cwd=wd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert said in plan.stdout, plan.stdout
    dry = snakemake(wd, "-n", "--configfile", "dtype.yaml")
    assert "rule generate_shard:" in dry.stdout + dry.stderr
    run = snakemake(wd, target, "--configfile", "dtype.yaml")
    assert run.returncode == 0, failed(run)
    log = (wd / "results/logs/generate/code/000/generate.log").read_text()
    assert said in log, log[-3000:]
    meta = json.loads((wd / "results/generated/code/000.meta.json").read_text())
    assert meta["fingerprint_change"]["records"] == journaled
    assert meta["counts"]["requested"] > 0

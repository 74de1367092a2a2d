"""A bad config fails before any job starts, with a message that names the key."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tokenmill.config import ConfigError, check_config

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


@pytest.fixture
def base_config():
    with open(ROOT / "config.yaml") as f:
        return yaml.safe_load(f)


def _keys(obj, path=()):
    """Every key path of a parsed YAML tree (mappings only), parents before their children."""
    for k, v in obj.items():
        yield (*path, k)
        if isinstance(v, dict):
            yield from _keys(v, (*path, k))


def _at(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def restated_defaults(config: dict) -> list[str]:
    """The keys of `config` whose value is what the schema fills in when the key is left out."""
    from tokenmill.settings import validate_schema

    filled = validate_schema(copy.deepcopy(config))
    out = []
    for path in _keys(config):
        without = copy.deepcopy(config)
        del _at(without, path[:-1])[path[-1]]
        try:
            refilled = validate_schema(without)
        except ConfigError:
            continue  # required, or needed by another key: not a default
        try:
            if _at(refilled, path) == _at(filled, path):
                out.append(".".join(path))
        except KeyError:
            continue
    return out


def test_bundled_config_restates_no_default(base_config):
    """config.yaml holds what the demo sets; the schema owns every default."""
    assert restated_defaults(base_config) == []
    # the check finds one (it can fail)
    assert restated_defaults({**base_config, "journal_dir": "journal"}) == ["journal_dir"]


def test_bundled_config_is_valid(base_config):
    config = check_config(copy.deepcopy(base_config), ROOT)
    # Defaults from the schema are filled in.
    assert config["categories"]["chat"]["turns"] == "last"
    assert config["generation"]["retry"]["max_attempts"] == 8


def _broken(config, mutate):
    config = copy.deepcopy(config)
    mutate(config)
    return config


CASES = {
    "unknown key": (
        lambda c: c["tokenizer"].update(pathh="x"),
        "tokenizer",
        "('pathh' was unexpected) (did you mean 'path'?)",
    ),
    "unknown top-level key": (
        lambda c: c.update(max_promt_tokens=5),
        "<top level>",
        "('max_promt_tokens' was unexpected) (did you mean 'max_prompt_tokens'?)",
    ),
    "unknown key in a shared shape": (
        lambda c: c.update(reject_limits={"merge": {"max_frac": 0.3}}),
        "reject_limits.merge",
        "('max_frac' was unexpected) (did you mean 'max_fraction'?)",
    ),
    "two unknown keys": (
        lambda c: c["categories"]["code"].update(shard=2, formatt="glaive"),
        "categories.code",
        "(did you mean 'format' for 'formatt', 'shards' for 'shard'?)",
    ),
    "tokenizer path typo": (
        lambda c: c["tokenizer"].update(path="sample/modle"),
        "tokenizer.path",
        "'sample/modle' does not exist (relative to '",
    ),
    "model path typo": (
        lambda c: c["generation"].update(model="sample/modle"),
        "generation.model",
        "folder 'sample' exists here); did you mean 'sample/model'?",
    ),
    "absolute tokenizer path": (
        lambda c: c["tokenizer"].update(path="/no/such/tokenizer"),
        "tokenizer.path",
        "read as a local path because it starts with '/'",
    ),
    "tokenizer name without org": (
        lambda c: c["tokenizer"].update(path="modle"),
        "tokenizer.path",
        "it is not a Hugging Face hub id (org/name)",
    ),
    "wrong type": (
        lambda c: c["categories"]["code"].update(shards="four"),
        "categories.code.shards",
        "is not of type 'integer'",
    ),
    "missing tokenizer": (lambda c: c.pop("tokenizer"), "<top level>", "'tokenizer'"),
    "unknown format": (
        lambda c: c["categories"]["chat"].update(format="alpaca"),
        "categories.chat.format",
        "'alpaca' is not one of",
    ),
    "no sources": (
        lambda c: c["categories"]["chat"].update(sources=[]),
        "categories.chat.sources",
        "should be non-empty",
    ),
    "missing source file": (
        lambda c: c["categories"]["chat"].update(sources=["sample/data/nope/*.json"]),
        "categories.chat.sources.0",
        "no file matches",
    ),
    "missing tokenizer dir": (
        lambda c: c["tokenizer"].update(path="./no/such/dir"),
        "tokenizer.path",
        "'./no/such/dir' does not exist",
    ),
    "unknown sampling key": (
        lambda c: c["generation"]["sampling"].update(seed=1),
        "generation.sampling",
        "no 'seed' key",
    ),
    # OpenCodeInstruct keeps its question in `input`: {instruction: input} alone would also
    # read `input` as the (default) input column and send every question twice.
    "instruction column is the default input column": (
        lambda c: c["categories"]["code"].update(format_options={"instruction": "input"}),
        "categories.code.format_options.input",
        "roles 'instruction' and 'input' both read column 'input' ('input' by default)",
    ),
    "two roles set to one column": (
        lambda c: c["categories"]["code"].update(format_options={"input": "q", "system": "q"}),
        "categories.code.format_options.system",
        "both read column 'q'",
    ),
    "draft vocab size zero": (
        lambda c: c["dataset"].update(draft_vocab_size=0),
        "dataset.draft_vocab_size",
        "less than the minimum of 1",
    ),
    "draft vocab weight of no category": (
        lambda c: c["dataset"].update(draft_vocab_weights={"chat": 2, "cod": 1}),
        "dataset.draft_vocab_weights.cod",
        "'cod' is not a category",
    ),
    "negative draft vocab weight": (
        lambda c: c["dataset"].update(draft_vocab_weights={"chat": -1}),
        "dataset.draft_vocab_weights.chat",
        "less than the minimum of 0",
    ),
    "draft vocab larger than its target": (
        lambda c: c["dataset"].update(draft_vocab_size=800, draft_vocab_target_size=720),
        "dataset.draft_vocab_size",
        "larger than dataset.draft_vocab_target_size 720",
    ),
    "unknown draft vocab format": (
        lambda c: c["dataset"].update(draft_vocab_formats=["eagle"]),
        "dataset.draft_vocab_formats.0",
        "'eagle' is not one of",
    ),
    "hook without function": (
        lambda c: c["categories"]["chat"].update(format="hook", hook="sample.hooks:nope"),
        "categories.chat.hook",
        "has no function 'nope'",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_names_the_key(base_config, case):
    mutate, key, expected = CASES[case]
    with pytest.raises(ConfigError) as err:
        check_config(_broken(base_config, mutate), ROOT)
    message = str(err.value)
    assert f"config key '{key}'" in message, message
    assert expected in message, message


def test_opencodeinstruct_layout_is_one_line(base_config):
    config = copy.deepcopy(base_config)
    config["categories"]["code"]["format_options"] = {"instruction": "input", "input": None}
    check_config(config, ROOT)


def test_bad_config_fails_snakemake_before_any_job(base_config, tmp_path):
    bad = _broken(base_config, lambda c: c["categories"]["code"].update(shards="four"))
    bad["results_dir"] = str(tmp_path / "results")
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(bad))
    proc = subprocess.run(
        [SNAKEMAKE, "--cores", "1", "--configfile", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "categories.code.shards" in out, out
    assert not (tmp_path / "results").exists(), "a job ran despite the bad config"


def _no_network(monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("check-config tried the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_hub_ids_are_checked_in_the_local_cache_only_when_offline(base_config, monkeypatch,
                                                                   tmp_path):  # fmt: skip
    _no_network(monkeypatch)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    config = _broken(base_config, lambda c: c["tokenizer"].update(path="some-org/some-model"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="hub id 'some-org/some-model' is not in the local"):
        check_config(copy.deepcopy(config), ROOT)
    (tmp_path / "models--some-org--some-model" / "snapshots").mkdir(parents=True)
    check_config(copy.deepcopy(config), ROOT)  # cached: fine
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    (tmp_path / "models--some-org--some-model" / "snapshots").rmdir()
    check_config(copy.deepcopy(config), ROOT)  # online: the hub is tokenize's business


def test_tokenizer_typo_fails_snakemake_before_any_job(base_config, tmp_path):
    bad = _broken(base_config, lambda c: c["tokenizer"].update(path="sample/modle"))
    bad["results_dir"] = str(tmp_path / "results")
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(bad))
    proc = subprocess.run(
        [SNAKEMAKE, "--cores", "1", "--configfile", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "0"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "config key 'tokenizer.path': 'sample/modle' does not exist" in out, out
    assert "did you mean 'sample/model'?" in out, out
    assert not (tmp_path / "results").exists(), "a job ran despite the bad config"


def test_slurm_tools_problem_is_one_sentence():
    from types import SimpleNamespace

    from tokenmill.workflow_support import slurm_tools_problem

    slurm = SimpleNamespace(executor_plugin=SimpleNamespace(name="slurm", cli_prefix="slurm"))
    local = SimpleNamespace(executor_plugin=SimpleNamespace(name="local", cli_prefix="local"))
    assert slurm_tools_problem(local, which=lambda t: None) is None
    assert slurm_tools_problem(slurm, which=lambda t: f"/usr/bin/{t}") is None
    only_squeue = slurm_tools_problem(slurm, which=lambda t: "/x" if t != "sacct" else None)
    assert only_squeue is None  # the plugin follows jobs with squeue when sacct is missing
    none = slurm_tools_problem(slurm, which=lambda t: None)
    assert "sbatch and sacct (or squeue) are not on PATH" in none and "\n" not in none


@pytest.mark.e2e
def test_slurm_executor_without_slurm_commands_fails_in_one_sentence(tmp_path):
    """No SLURM command is reachable (PATH holds the venv and a few shell tools only), so
    nothing can be submitted: the run stops before any job with one sentence."""
    import shutil

    from helpers import copy_workflow

    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("bash", "sh", "env", "which"):
        (tools / name).symlink_to(shutil.which(name))
    workdir = copy_workflow(tmp_path / "wf")
    proc = subprocess.run(
        [SNAKEMAKE, "--executor", "slurm", "--jobs", "1", "--cores", "1",
         "results/prompts/chat.parquet"],
        cwd=workdir, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": f"{tools}{os.pathsep}{Path(SNAKEMAKE).parent}"},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "the slurm executor (--profile slurm, or --executor slurm) needs SLURM's commands" in out
    assert "Traceback" not in out, out[-3000:]
    assert not (workdir / "results").exists(), "a job ran"


NO_CLUSTER_CONF = """\
ClusterName=nowhere
SlurmctldHost=localhost
SlurmctldPort={port}
AuthType=auth/munge
NodeName=localhost CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES State=UP
"""


def no_cluster_conf(tmp_path) -> Path:
    """A slurm.conf whose controller nobody runs (a port nothing listens on) and which keeps
    no accounting: SLURM's real client answers as on a machine with the client and no cluster."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "slurm.conf"
    conf.write_text(NO_CLUSTER_CONF.format(port=port))
    return conf


def needs_slurm_client():
    import shutil

    if not all(shutil.which(t) for t in ("sbatch", "scontrol", "sacct")):
        if os.environ.get("CI") == "true":
            pytest.fail("SLURM's client is not installed under CI=true: make test-deps installs it")
        pytest.skip("SLURM's client is not installed (apt-get install slurm-client)")


@pytest.mark.e2e
def test_slurm_client_without_a_cluster_fails_before_any_job_in_one_sentence(tmp_path):
    """SLURM's commands are installed, no controller answers: the run stops at its start with
    one sentence naming `scontrol ping`'s answer, not one `sinfo: fatal` block per job."""
    from helpers import copy_workflow, tool_env

    needs_slurm_client()
    workdir = copy_workflow(tmp_path / "wf")
    proc = subprocess.run(
        [SNAKEMAKE, "--profile", "profiles/slurm", "results/prompts/chat.parquet"],
        cwd=workdir, capture_output=True, text=True, timeout=300,
        env=tool_env(SLURM_CONF=str(no_cluster_conf(tmp_path))),
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "SLURM's controller does not answer (scontrol ping: " in out, out[-3000:]
    assert "Traceback" not in out and "sinfo: fatal" not in out, out[-3000:]
    assert not (workdir / "results").exists(), "a job ran"


def test_sacct_without_accounting_names_the_status_command_to_set(tmp_path, monkeypatch):
    """The real sacct against a cluster config without accounting; the controller is taken as
    up (scontrol ping is the one answer replaced): the sentence says what to set."""
    from types import SimpleNamespace

    from tokenmill.workflow_support import slurm_cluster_problem

    needs_slurm_client()
    monkeypatch.setenv("SLURM_CONF", str(no_cluster_conf(tmp_path)))

    def run(argv, **kw):
        if argv[:2] == ["scontrol", "ping"]:
            return subprocess.CompletedProcess(argv, 0, "Slurmctld(primary) at x is UP\n", "")
        return subprocess.run(argv, **kw)

    plugin = SimpleNamespace(name="slurm", cli_prefix="slurm")
    sacct = SimpleNamespace(executor_plugin=plugin, executor_settings=SimpleNamespace())
    line = slurm_cluster_problem(sacct, run=run)
    assert line and "accounting storage is disabled" in line, line
    assert "`slurm-status-command: squeue`" in line and "\n" not in line
    squeue = SimpleNamespace(
        executor_plugin=plugin, executor_settings=SimpleNamespace(status_command="squeue")
    )
    assert slurm_cluster_problem(squeue, run=run) is None
    # The controller down, said before anything else, by the real scontrol.
    down = slurm_cluster_problem(sacct)
    assert down and down.startswith("SLURM's controller does not answer"), down

"""Helpers the Snakefile calls at parse time. Cheap on purpose: no transformers or torch
imports here, because Snakemake parses the workflow in every job it starts."""

from __future__ import annotations

import hashlib
import shlex
import shutil
import subprocess
from pathlib import Path

from tokenmill.contracts import canonical_json, sha256_file
from tokenmill.prepare.sources import expand_paths
from tokenmill.settings import CategorySettings, TokenizerSettings
from tokenmill.tokenization.tokenizer import tokenizer_files


def local_source_files(category: CategorySettings, basedir) -> list[str]:
    """The files prepare will read (same expansion), as the rule's inputs."""
    files: list[str] = []
    for spec in category.source_specs():
        if "path" in spec:
            files += [shown for shown, _ in expand_paths(spec["path"], basedir)]
    return files


def tokenizer_params_fingerprint(cfg: TokenizerSettings, basedir) -> str:
    """The tokenize rule's rerun trigger: the tokenizer config and the sha256 of every local
    tokenizer file (weights excluded) and of a chat template override. Unlike
    tokenizer.tokenizer_fingerprint (which shards carry) it does not load the tokenizer, so the
    workflow parses fast; a hub tokenizer is covered by its id and revision."""
    h = hashlib.sha256(canonical_json(cfg.raw).encode())
    local = Path(basedir) / cfg.path
    files = tokenizer_files(local) if local.is_dir() else []
    if cfg.chat_template:
        template = Path(basedir) / cfg.chat_template
        files.append({"name": "chat_template", "sha256": sha256_file(template)})
    h.update(canonical_json([[f["name"], f["sha256"]] for f in files]).encode())
    return h.hexdigest()


def stale_lock_hint(argv: list[str], workdir=".") -> str | None:
    """What to do about Snakemake's lock, when one is present and this is not `--unlock`.

    A controller killed with SIGKILL (a lost login session, an out-of-memory kill) cannot
    remove its lock in .snakemake/locks, and every later start fails with "Directory cannot
    be locked". The hint names the command that removes it: the same one, plus --unlock.
    """
    locks = sorted((Path(workdir) / ".snakemake" / "locks").glob("*.lock"))
    if not locks or "--unlock" in argv:
        return None
    unlock = shlex.join(["snakemake", *argv[1:], "--unlock"])
    return (
        "tokenmill: Snakemake's lock is present (.snakemake/locks). If another snakemake is "
        "running in this directory, let it finish. If none is (a killed controller leaves its "
        f"lock behind), remove the lock with the same command plus --unlock:\n    {unlock}\n"
        "then start the run again: finished jobs are kept, generate resumes from the journal."
    )


SLURM_QUERY_TIMEOUT_S = 30


def _uses_slurm(workflow) -> bool:
    plugin = getattr(workflow, "executor_plugin", None)
    return "slurm" in (getattr(plugin, "cli_prefix", None), getattr(plugin, "name", None))


def _first_line(proc) -> str:
    text = (proc.stderr or "") + (proc.stdout or "")
    return next((line.strip() for line in text.splitlines() if line.strip()), "no output")


def slurm_cluster_problem(workflow, run=subprocess.run) -> str | None:
    """One sentence when SLURM's commands are here but the cluster cannot take the run: its
    controller does not answer (`scontrol ping`; every job and retry would print its own
    `sinfo: fatal` block), or the executor follows jobs with sacct and the cluster keeps no
    accounting (the controller would wait without a word after its jobs ended). None
    otherwise, and when the commands themselves are missing (slurm_tools_problem says it)."""
    if not _uses_slurm(workflow) or not shutil.which("scontrol"):
        return None
    kw = {"capture_output": True, "text": True, "timeout": SLURM_QUERY_TIMEOUT_S}
    try:
        ping = run(["scontrol", "ping"], **kw)
    except subprocess.TimeoutExpired:
        ping = None
    if ping is None or (ping.returncode != 0 and " is UP" not in ping.stdout):
        said = f"no answer in {SLURM_QUERY_TIMEOUT_S} s" if ping is None else _first_line(ping)
        return (
            f"SLURM's controller does not answer (scontrol ping: {said}): run Snakemake where "
            "the cluster answers (its login node), or use --profile profiles/local"
        )
    settings = getattr(workflow, "executor_settings", None)
    status_command = getattr(settings, "status_command", None) or "sacct"
    if status_command != "sacct" or not shutil.which("sacct"):
        return None
    try:
        sacct = run(["sacct", "-n", "-X", "-j", "1", "-o", "JobID"], **kw)
    except subprocess.TimeoutExpired:
        return None  # slow accounting is still accounting
    if sacct.returncode == 0:
        return None
    return (
        f"the slurm executor follows jobs with sacct, and sacct fails here ({_first_line(sacct)}): "
        "on a cluster without job accounting add `slurm-status-command: squeue` to your profile "
        "(profiles/slurm/config.yaml says what squeue needs)"
    )


def on_start(workflow, lay, settings) -> list[str]:
    """The controller's first act once the jobs are planned (the Snakefile's onstart, after
    slurm_tools_problem): the files the config no longer declares retired from the published
    folders (one line per category, printed now and returned for the closing summary); the
    preemption watchdog on SLURM."""
    import sys

    from tokenmill import retire
    from tokenmill.jobs import preemption

    lines = retire.retire_undeclared(lay, settings)
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    preemption.start_for_workflow(workflow, settings.jobs)
    return lines


def slurm_tools_problem(workflow, which=shutil.which) -> str | None:
    """One sentence when the run submits to SLURM (the slurm executor) but this machine lacks
    the SLURM commands the executor calls (sbatch to submit; sacct, or squeue, to follow jobs);
    None otherwise. The Snakefile's onstart raises it before any job is submitted, instead of
    one traceback per job."""
    if not _uses_slurm(workflow):
        return None
    missing = [] if which("sbatch") else ["sbatch"]
    if not (which("sacct") or which("squeue")):
        missing.append("sacct (or squeue)")
    if not missing:
        return None
    return (
        f"the slurm executor (--profile slurm, or --executor slurm) needs SLURM's commands on "
        f"this machine, and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
        "on PATH: run Snakemake on the cluster's login node, or use --profile profiles/local"
    )

"""Helpers the Snakefile calls at parse time. Cheap on purpose: no transformers or torch
imports here, because Snakemake parses the workflow in every job it starts."""

from __future__ import annotations

import hashlib
import shlex
import shutil
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
    plugin = getattr(workflow, "executor_plugin", None)
    if "slurm" not in (getattr(plugin, "cli_prefix", None), getattr(plugin, "name", None)):
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

"""Configuration checks the schema cannot express, and `tokenmill check-config`.

Schema validation with defaults and the typed settings live in tokenmill/settings.py (the
schema is the only place a default lives). This module is a top-layer module, like cli.py and
workflow_support.py: it may import stages (source expansion, hooks, engines, resources) to
check that a config can run. Used by the Snakefile, so a bad config fails before any job
starts; errors name the key and what was expected.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from pathlib import Path

from tokenmill import layout
from tokenmill.keys import generation_fingerprint
from tokenmill.prepare.hooks import load_hook
from tokenmill.prepare.sources import SourceError, expand_paths
from tokenmill.settings import (  # noqa: F401 - re-exported for the Snakefile and tests
    ENV_CONFIG,
    ENV_CONFIGFILES,
    ENV_GENERATION,
    ENV_JOURNAL_DIR,
    SCHEMA_PATH,
    ConfigError,
    Settings,
    as_settings,
    load_config_file,
    load_schema,
    thaw,
    validate_schema,
)

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
LOCAL_PREFIXES = ("/", "./", "../", "~")


def _local_path(path: str, base: Path) -> Path:
    return Path(path).expanduser() if path.startswith("~") else base / path


def _looks_local(path: str, base: Path) -> str | None:
    """Why `path` (tokenizer.path, generation.model) is meant as a local path, or None when it
    has the shape of a hub id (org/name) with no local folder above it."""
    if path.startswith(LOCAL_PREFIXES):
        return f"it starts with {next(p for p in LOCAL_PREFIXES if path.startswith(p))!r}"
    if not HUB_ID.fullmatch(path):
        return "it is not a Hugging Face hub id (org/name)"
    parent = _local_path(path, base).parent
    if parent.is_dir():
        return f"its folder '{Path(path).parent}' exists here"
    return None


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _in_hub_cache(hub_id: str, repo_type: str = "model") -> bool:
    """Whether the local Hugging Face cache holds a snapshot of `hub_id` (no network)."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return False
    folder = f"{repo_type}s--" + hub_id.replace("/", "--")
    return (Path(HF_HUB_CACHE) / folder / "snapshots").is_dir()


def hf_command(args: str) -> str:
    """A `hf` command line the user can run as printed: the CLI beside this interpreter (the
    venv's; `huggingface-cli` is not installed with huggingface_hub 1.x and later)."""
    beside = Path(sys.executable).parent / "hf"
    return f"{beside if beside.is_file() else 'hf'} {args}"


def path_problem(key: str, path: str, base: Path) -> str | None:
    """What is wrong with a tokenizer or model path, without any hub access: a path that looks
    local and does not exist (with the closest existing name beside it), or, with
    HF_HUB_OFFLINE=1, a hub id missing from the local cache."""
    local = _local_path(path, base)
    if local.exists():
        return None
    why = _looks_local(path, base)
    if why is None:
        if _hub_offline() and not _in_hub_cache(path):
            return (
                f"config key '{key}': hub id '{path}' is not in the local Hugging Face cache "
                f"and HF_HUB_OFFLINE is set (download it first: {hf_command('download ' + path)})"
            )
        return None
    hint = ""
    if local.parent.is_dir():
        close = difflib.get_close_matches(local.name, [p.name for p in local.parent.iterdir()], 1)
        if close:
            hint = f"; did you mean '{Path(path).parent / close[0]}'?"
    return (
        f"config key '{key}': '{path}' does not exist (relative to '{base}'; read as a local "
        f"path because {why}){hint}"
    )


HUB_TIMEOUT_S = 5.0  # per question; a typo must fail in seconds, not after a job's retries


def hub_ids(s: Settings, base: Path) -> list[tuple[str, str, str, str | None]]:
    """(config key, repo type, hub id, revision) of every hub repository the run downloads:
    the tokenizer, the managed engine's model and the categories' hub sources."""
    out = []
    if (
        _looks_local(s.tokenizer.path, base) is None
        and not _local_path(s.tokenizer.path, base).exists()
    ):
        out.append(("tokenizer.path", "model", s.tokenizer.path, s.tokenizer.revision))
    gen = s.generation
    if gen.managed and gen.model and _looks_local(gen.model, base) is None:  # noqa: SIM102
        if not _local_path(gen.model, base).exists():
            out.append(("generation.model", "model", gen.model, gen.revision))
    for name, cat in sorted(s.categories.items()):
        for i, src in enumerate(cat.source_specs()):
            if src.get("hub"):
                key = f"categories.{name}.sources[{i}].hub"
                out.append((key, "dataset", src["hub"], src.get("revision")))
    return out


def hub_problems(s: Settings, basedir: str | Path = ".") -> list[str]:
    """Ask the hub whether each repository the run downloads exists, for the ones the local
    cache does not hold: one line per problem, in seconds, before any job starts (the
    controller only: a job may run where there is no network). Nothing is asked with
    HF_HUB_OFFLINE=1 (path_problem checks the cache then)."""
    if _hub_offline():
        return []
    wanted = [w for w in hub_ids(s, Path(basedir)) if not _in_hub_cache(w[2], w[1])]
    if not wanted:
        return []
    from huggingface_hub import HfApi, constants
    from huggingface_hub import errors as hf_errors

    api, problems = HfApi(), []
    for key, repo_type, repo, revision in wanted:
        at = f"hub id '{repo}'" + (f" at revision '{revision}'" if revision else "")
        try:
            if repo_type == "dataset":
                api.dataset_info(repo, revision=revision, timeout=HUB_TIMEOUT_S)
            else:
                api.model_info(repo, revision=revision, timeout=HUB_TIMEOUT_S)
        except hf_errors.GatedRepoError:
            problems.append(
                f"config key '{key}': {at} is gated: accept its terms on "
                f"{constants.ENDPOINT}/{'datasets/' if repo_type == 'dataset' else ''}{repo} "
                f"and log in ({hf_command('auth login')}) or set HF_TOKEN"
            )
        except hf_errors.RevisionNotFoundError:
            problems.append(f"config key '{key}': {at}: the revision does not exist on the hub")
        except hf_errors.RepositoryNotFoundError:
            problems.append(
                f"config key '{key}': {at} does not exist on {constants.ENDPOINT} (a typo? a "
                f"private repository needs {hf_command('auth login')} or HF_TOKEN)"
            )
        except Exception as exc:  # no network, DNS, TLS, timeout: the job could not download
            problems.append(
                f"config key '{key}': {at} is not in the local Hugging Face cache and "
                f"{constants.ENDPOINT} cannot be reached ({type(exc).__name__}); download it "
                f"where there is network ({hf_command('download ' + repo)}"
                + (" --repo-type dataset" if repo_type == "dataset" else "")
                + "), then run with HF_HUB_OFFLINE=1"
            )
    return problems


def check_semantics(config: Settings | dict, basedir: str | Path = ".") -> None:
    """Checks beyond the schema: files exist, hooks import, formats have what they need."""
    s = config if isinstance(config, Settings) else Settings.from_validated(config)
    base = Path(basedir)
    problems: list[str] = []
    tok = s.tokenizer
    problems += filter(None, [path_problem("tokenizer.path", tok.path, base)])
    if tok.chat_template and not (base / tok.chat_template).is_file():
        problems.append(
            f"config key 'tokenizer.chat_template': file '{tok.chat_template}' does not exist"
        )
    for name in sorted(set(s.categories) & set(layout.RESERVED_CATEGORIES)):
        problems.append(
            f"config key 'categories.{name}': the name is reserved (the dataset folder and its "
            "card use it); rename the category"
        )
    for name, cat in s.categories.items():
        specs = cat.source_specs()
        for i, spec in enumerate(specs):
            key = f"categories.{name}.sources.{i}"
            if "path" in spec:
                try:
                    expand_paths(spec["path"], base)  # what prepare will read
                except SourceError:
                    problems.append(f"config key '{key}': no file matches '{spec['path']}'")
        fmt_formats = {spec["format"] for spec in specs}
        if "instruction" in fmt_formats:
            from tokenmill.prepare.formats import ColumnClash, instruction_columns

            try:
                instruction_columns(thaw(cat.format_options))
            except ColumnClash as exc:
                problems.append(f"config key 'categories.{name}.format_options.{exc.role}': {exc}")
        if "hook" in fmt_formats:
            if not cat.hook:
                problems.append(
                    f"config key 'categories.{name}.hook': format 'hook' needs "
                    "hook: 'module:function'"
                )
            else:
                try:
                    load_hook(cat.hook, base)
                except Exception as exc:  # noqa: BLE001 - reported with the key
                    problems.append(f"config key 'categories.{name}.hook': {exc}")
    ds = s.dataset
    for cat in sorted(set(ds.draft_vocab_weights) - set(s.categories)):
        problems.append(
            f"config key 'dataset.draft_vocab_weights.{cat}': {cat!r} is not a category"
        )
    size, target = ds.draft_vocab_size, ds.draft_vocab_target_size
    if size is not None and target is not None and size > target:
        problems.append(
            f"config key 'dataset.draft_vocab_size': {size} is larger than "
            f"dataset.draft_vocab_target_size {target}"
        )
    elif size is not None and target is None:
        from tokenmill import model

        # The draft_vocab rule reads the same vocab_size; a model not on this machine is
        # checked there (and by generate).
        vocab, where = model.model_vocab_size(s.generation.model, base, s.generation.revision)
        if vocab is not None and size > vocab:
            problems.append(
                f"config key 'dataset.draft_vocab_size': {size} is larger than the model's "
                f"vocabulary ({vocab} ids, vocab_size in {where}); lower it or set "
                "dataset.draft_vocab_target_size"
            )
    gen = s.generation
    if gen.model is None:
        problems.append("config key 'generation.model': required (the model to serve)")
    elif gen.managed:  # an external server's model need not be on this machine
        problems += filter(None, [path_problem("generation.model", gen.model, base)])
    if gen.managed and not gen.launch.command:
        problems.append("config key 'generation.launch.command': required in managed mode")
    if gen.mode == "external" and not gen.external.urls:
        problems.append("config key 'generation.external.urls': required in external mode")
    from tokenmill import engines

    try:
        engines.validate(gen)
    except ValueError as exc:
        problems.append(f"config key 'generation.sampling': {exc}")
    try:
        engines.validate_launch(gen)
    except ValueError as exc:
        problems.append(f"config key 'generation.seed_policy': {exc}")
    from tokenmill.jobs import resources

    problems += resources.problems(s)
    problems += hidden_states_problems(s, base)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def hidden_states_problems(s: Settings, base: Path) -> list[str]:
    """hidden_states (when enabled): a model whose config.json is here, layer ids it has, what
    the vllm backend needs (a launch command, or external URLs)."""
    hs = s.hidden_states
    if not hs.enabled:
        return []
    from tokenmill.hidden_states import layout, stage

    problems = stage.backend_problems(s)
    conflict = layout.folder_conflicts(hs.layouts)
    if conflict:
        problems.append(f"config key 'hidden_states.layouts': {conflict}")
    try:
        stage.plan_layers(s, base)
    except layout.LayoutError as exc:
        problems.append(
            str(exc) if "config key" in str(exc) else f"config key 'hidden_states.model': {exc}"
        )
    return problems


# Top-level keys that say where or how to run, not what to produce.
OPERATIONAL_TOP_KEYS = ("journal_dir", "reject_limits", "jobs")
# The hidden_states keys that shape its files (the others say how or where it runs).
HIDDEN_STATES_KEYS = ("enabled", "backend", "model", "layers", "layouts")


def job_environment(config: Settings | dict, configfiles=()) -> dict[str, str]:
    """The environment variables that hand jobs their operational settings (the validated
    config as JSON: each job's command loads its section with settings.load_section)."""
    config = as_settings(config)
    return {
        ENV_CONFIG: json.dumps(config.raw, sort_keys=True),
        ENV_GENERATION: json.dumps(config.generation.raw, sort_keys=True),
        ENV_JOURNAL_DIR: config.journal_dir,
        ENV_CONFIGFILES: json.dumps([str(f) for f in configfiles]),
    }


def outputs_config(config: Settings | dict) -> dict:
    """The config as far as it shapes outputs: the rerun trigger of the rules that read the
    whole config (stats, card, provenance). Generation counts only through its fingerprint
    (model, revision, engine, sampling, stop tokens, seed policy, token-affecting launch
    flags): concurrency, retries, timeouts, resources, start-up limits, URLs and the like do
    not change a token, and neither does where the journal lives."""
    config = as_settings(config)
    view = {k: v for k, v in config.raw.items() if k not in OPERATIONAL_TOP_KEYS}
    view["generation"] = {"fingerprint": generation_fingerprint(config.generation)}
    # The hidden_states section counts only when the stage runs, and only what shapes its files.
    view.pop("hidden_states", None)
    if config.hidden_states.enabled:
        view["hidden_states"] = {k: config.hidden_states.raw[k] for k in HIDDEN_STATES_KEYS}
    return view


def merge_dataset_config(dataset: dict) -> dict:
    """The dataset section as merge uses it: export_jsonl only adds the export jobs, and the
    draft_vocab_* keys only shape the draft vocabulary (merge counts every loss token anyway)."""
    return {
        k: v for k, v in dataset.items() if k != "export_jsonl" and not k.startswith("draft_vocab")
    }


def check_config(config: dict, basedir: str | Path = ".") -> dict:
    """Full check (schema + semantics). Fills the defaults into `config` (in place: the
    Snakefile's config object) and returns it."""
    validate_schema(config)
    check_semantics(Settings.from_validated(config), basedir)
    return config


def load_config(path: str | Path, basedir: str | Path = ".") -> dict:
    return check_config(load_config_file(path), basedir)


def main(argv: list[str]) -> int:
    """`tokenmill check-config CONFIG`: validate a config and print it with defaults filled in."""
    import argparse

    parser = argparse.ArgumentParser(prog="tokenmill check-config")
    parser.add_argument("config")
    parser.add_argument("--basedir", default=".")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.basedir)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    json.dump(config, sys.stdout, indent=2, sort_keys=True)
    print()
    return 0

"""Typed, read-only settings: one frozen dataclass per config section, built once from the
schema-validated config.

The JSON schema (workflow/schemas/config.schema.yaml) is the only place a default lives:
validation fills every default in, and the dataclasses below copy the validated values without
adding any of their own (a field is None only where the schema gives the key no default).
Stages receive these objects, never raw dicts with `.get(key, default)` fallbacks.

A stage command loads what it is given with `load_section(value, "generation")`: inline JSON or
a file path, holding the whole config or just that section, validated against that section's
part of the schema; a partial or wrong section fails with a ConfigError naming the full key.
Each object keeps `.raw`, the validated dict, for fingerprints and JSON hand-off to jobs.

This module sits below the stages: it imports no stage module.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jsonschema
import yaml

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "config.schema.yaml"

# Top-level keys whose value is a section with its own settings class (see load_section).
SECTIONS = ("tokenizer", "generation", "dataset", "categories", "hidden_states", "jobs")


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


# --------------------------------------------------------------------------------------------
# Schema validation with defaults


def _key(path) -> str:
    parts = [str(p) for p in path]
    return ".".join(parts) if parts else "<top level>"


def _with_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = json.loads(json.dumps(sub["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_schema() -> dict:
    """The config's JSON schema (a fresh copy: callers may modify it)."""
    return copy.deepcopy(_schema())


def _did_you_mean(error: jsonschema.ValidationError) -> str:
    """' (did you mean 'model'?)' for an additionalProperties error whose unknown keys are
    close to known ones (difflib); '' otherwise."""
    known = error.schema.get("properties") if isinstance(error.schema, dict) else None
    if not known or not isinstance(error.instance, dict):
        return ""
    unknown = sorted(k for k in error.instance if k not in known)
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
        if close:
            hints.append(f"'{close[0]}'" + (f" for '{name}'" if len(unknown) > 1 else ""))
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _describe(error: jsonschema.ValidationError, prefix: tuple = ()) -> str:
    key = _key([*prefix, *error.absolute_path])
    if error.validator == "additionalProperties":
        return f"config key '{key}': {error.message}{_did_you_mean(error)}"
    if error.validator == "required":
        return f"config key '{key}': {error.message}"
    if error.validator == "oneOf" and error.context:
        best = jsonschema.exceptions.best_match(error.context)
        return f"config key '{key}': {best.message}"
    expected = error.schema.get("description") or error.schema.get("type") or ""
    hint = f" (expected {expected})" if expected and error.validator != "type" else ""
    return f"config key '{key}': {error.message}{hint}"


@functools.lru_cache(maxsize=1)
def _validator_class():
    return _with_defaults(jsonschema.Draft202012Validator)


def _validate(instance, schema: dict, prefix: tuple = ()):
    validator = _validator_class()(schema)
    errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
    if errors:
        raise ConfigError(
            "invalid configuration:\n  " + "\n  ".join(_describe(e, prefix) for e in errors)
        )
    return instance


def validate_schema(config: dict) -> dict:
    """Validate against the JSON schema and fill in defaults (in place). Raises ConfigError."""
    return _validate(config, _schema())


def section_schema(section: str) -> dict:
    """The part of the schema that describes one top-level key, or one category for
    "categories.NAME" (with the shared $defs)."""
    schema = _schema()
    if section.startswith("categories."):
        return {**schema["$defs"]["category"], "$defs": schema["$defs"]}
    if section not in schema["properties"]:
        raise ConfigError(f"no config section '{section}' (known: {', '.join(SECTIONS)})")
    return {**schema["properties"][section], "$defs": schema["$defs"]}


def validate_section(value, section: str) -> Any:
    """Validate one section (a copy) and fill in its defaults. Errors name `section.key`."""
    value = copy.deepcopy(value)
    schema = section_schema(section)
    if value is None and "default" in schema:
        value = json.loads(json.dumps(schema["default"]))
    return _validate(value, schema, tuple(section.split(".", 1)))


# --------------------------------------------------------------------------------------------
# JSON arguments of stage commands


def json_arg(value: str, what: str = "argument") -> dict:
    """A JSON object given inline ('{...}', as the Snakemake rules pass it) or as a file path."""
    text = value if value.lstrip().startswith("{") else Path(value).read_text(encoding="utf-8")
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise ValueError(f"{what} must be a JSON object (or a file holding one)")
    return obj


def _is_whole_config(obj: Mapping) -> bool:
    # The two keys the schema requires at the top level; no section has both.
    return "tokenizer" in obj and "categories" in obj


def load_section(value: str | Mapping, section: str | None):
    """A stage command's settings: `value` is inline JSON ('{...}'), a file path (JSON or
    YAML) or a dict, holding the whole config or just `section`. Validated with defaults
    filled; returns the section's settings object (Settings for section None or "config",
    a mapping name -> CategorySettings for "categories", the CategorySettings of one category
    for "categories.NAME"). Raises ConfigError naming the key."""
    if isinstance(value, Mapping):
        obj = dict(value)
    else:
        try:
            text = value if value.lstrip().startswith("{") else Path(value).read_text("utf-8")
            yaml_file = str(value).endswith((".yaml", ".yml"))
            obj = yaml.safe_load(text) if yaml_file else json.loads(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise ConfigError(f"config {section or ''} {value!r}: {exc}") from exc
        if not isinstance(obj, dict):
            raise ConfigError(f"config {section or ''} {value!r}: not a JSON object")
    if section in (None, "config"):
        return Settings.from_config(obj)
    if _is_whole_config(obj):
        whole = Settings.from_config(obj)
        if section.startswith("categories."):
            name = section.split(".", 1)[1]
            if name not in whole.categories:
                raise ConfigError(f"config key '{section}': no such category")
            return whole.categories[name]
        return getattr(whole, section)
    if list(obj) == [section]:  # {"reject_limits": {...}}: the section under its own key
        obj = obj[section]
    raw = validate_section(obj, section)
    if section == "categories":
        return _categories(raw)
    return _section_class(section).from_raw(raw)


def load_config_file(path: str | Path) -> dict:
    """A config file (YAML or JSON) as a dict, not yet validated."""
    with open(path) as f:
        return yaml.safe_load(f) if str(path).endswith((".yaml", ".yml")) else json.load(f)


# What a job needs but must not rerun on: the rules read these variables in their shell
# commands (set by workflow/rules/common.smk from the resolved config at parse time, see
# config.job_environment); a job's command loads its section from them with load_section.
ENV_CONFIG = "TOKENMILL_CONFIG_JSON"  # the whole resolved config
ENV_GENERATION = "TOKENMILL_GENERATION_JSON"  # its generation section
ENV_JOURNAL_DIR = "TOKENMILL_JOURNAL_DIR"
ENV_CONFIGFILES = "TOKENMILL_CONFIGFILES_JSON"  # the --configfile paths, a JSON list


# --------------------------------------------------------------------------------------------
# Settings objects


def freeze(value):
    """A read-only copy: dicts become MappingProxyType, lists tuples (recursively)."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value):
    """The plain JSON-able form of a frozen value (dicts and lists)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return value


def _nested(cls):
    return field(metadata={"section": cls})


class _Section:
    """Builds a frozen dataclass from a validated dict: each field is the key of the same name
    (read-only), a nested section is built by its own class. Keys the schema gives no default
    may be absent: their field is None."""

    raw: dict

    @classmethod
    def from_raw(cls, raw: Mapping):
        raw = copy.deepcopy(dict(raw))
        values = {}
        for f in fields(cls):
            if f.name == "raw":
                continue
            sub = f.metadata.get("section")
            v = raw.get(f.name)  # absent only where the schema has no default: None
            values[f.name] = sub.from_raw(v if v is not None else {}) if sub else freeze(v)
        return cls(raw=raw, **values)


@dataclass(frozen=True)
class TokenizerSettings(_Section):
    raw: dict = field(repr=False, compare=False)
    path: str
    revision: str | None
    trust_remote_code: bool
    chat_template: str | None
    chat_template_kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class RetrySettings(_Section):
    raw: dict = field(repr=False, compare=False)
    max_attempts: int
    backoff_initial_s: float
    backoff_max_s: float
    fail_fast_after: int


@dataclass(frozen=True)
class RejectLimitSettings(_Section):
    raw: dict = field(repr=False, compare=False)
    max_fraction: float
    min_count: int


@dataclass(frozen=True)
class RejectLimitsSettings(_Section):
    """The rejection guards of the stages other than generate (tokenmill/guards.py)."""

    raw: dict = field(repr=False, compare=False)
    prepare: RejectLimitSettings = _nested(RejectLimitSettings)
    tokenize: RejectLimitSettings = _nested(RejectLimitSettings)
    merge: RejectLimitSettings = _nested(RejectLimitSettings)


@dataclass(frozen=True)
class LaunchSettings(_Section):
    raw: dict = field(repr=False, compare=False)
    command: tuple[str, ...] | None  # required in managed mode (a semantic check)
    host: str
    startup_timeout_s: float
    max_restarts: int
    nnodes: int
    env: Mapping[str, str]
    operational_flags: tuple[str, ...]  # more flags left out of the fingerprint
    launcher: tuple[str, ...] | None  # a multi-node engine's per-node launcher (None: srun)


@dataclass(frozen=True)
class ExternalSettings(_Section):
    raw: dict = field(repr=False, compare=False)
    urls: tuple[str, ...]


@dataclass(frozen=True)
class ResourceSettings(_Section):
    """SLURM resources of a generate job (generation.resources, or a category's effective
    resources: generation.resources with the category's overrides)."""

    raw: dict = field(repr=False, compare=False)
    gpus: int
    gpu_model: str | None
    cpus: int
    mem_mb: int
    max_mem_mb: int | None
    runtime_min: int
    max_runtime_min: int | None
    qos: str | None
    constraint: str | None


@dataclass(frozen=True)
class GenerationSettings(_Section):
    raw: dict = field(repr=False, compare=False)
    engine: str
    mode: str
    model: str | None  # required when generating (a semantic check)
    revision: str | None
    server_model: str | None
    launch: LaunchSettings = _nested(LaunchSettings)
    external: ExternalSettings = _nested(ExternalSettings)
    api_key_env: str | None
    sampling: Mapping[str, Any]
    stop_tokens: tuple[str | int, ...]
    seed_policy: str
    allow_ignored_seeds: bool
    concurrency: int
    request_timeout_s: float
    retry: RetrySettings = _nested(RetrySettings)
    reject_limit: RejectLimitSettings = _nested(RejectLimitSettings)
    progress_interval_s: float
    resources: ResourceSettings = _nested(ResourceSettings)

    @property
    def managed(self) -> bool:
        return self.mode == "managed"


@dataclass(frozen=True)
class CategorySettings(_Section):
    raw: dict = field(repr=False, compare=False)
    sources: tuple  # strings or read-only mappings, as written (see source_specs)
    format: str
    format_options: Mapping[str, str | None]
    hook: str | None
    turns: str
    context: str  # dataset | regenerated
    max_prompts: int | None
    sample_seed: int
    shards: int
    shard_by: str  # prefix | prompt_id (tokenization/shards.py)
    resources: Mapping[str, Any] | None  # only the keys it overrides in generation.resources

    @property
    def regenerated(self) -> bool:
        return self.context == "regenerated"

    def source_specs(self) -> list[dict]:
        """Every source as a dict: {path, format} or {hub, config, split, revision, format}."""
        return [normalize_source(thaw(s), self.raw) for s in self.sources]


@dataclass(frozen=True)
class DatasetSettings(_Section):
    raw: dict = field(repr=False, compare=False)
    max_sequence_tokens: int
    reject_truncated: bool
    think_end_token: str | None
    think_start_token: str | None
    require_think_end: bool
    export_jsonl: bool
    max_train_length: int | None
    draft_vocab_size: int | None
    draft_vocab_weights: Mapping[str, float]
    draft_vocab_target_size: int | None
    draft_vocab_formats: tuple[str, ...]
    draft_vocab_force_stop_ids: bool
    prefix_cache_block: int


@dataclass(frozen=True)
class HiddenStatesLaunchSettings(_Section):
    raw: dict = field(repr=False, compare=False)
    command: tuple[str, ...] | None  # required for a managed vllm backend (a semantic check)
    host: str
    startup_timeout_s: float
    env: Mapping[str, str]


@dataclass(frozen=True)
class HiddenStatesSettings(_Section):
    """The optional hidden_states stage (tokenmill/hidden_states/)."""

    raw: dict = field(repr=False, compare=False)
    enabled: bool
    backend: str  # hf | vllm
    model: str | None  # None: generation.model
    layers: tuple[int, ...] | None  # None: the default ids for the model's layer count
    drafter: str  # eagle3 (three auxiliary ids) | other (any number)
    layouts: tuple[str, ...]
    category_folders: bool  # a training folder per category too
    batch_tokens: int
    max_batch_rows: int | str  # a count, or "auto" (hf.batch_rows resolves it)
    device: str
    mode: str
    launch: HiddenStatesLaunchSettings = _nested(HiddenStatesLaunchSettings)
    external: ExternalSettings = _nested(ExternalSettings)
    resources: Mapping[str, Any]  # only the keys it overrides in generation.resources


@dataclass(frozen=True)
class JobsSettings(_Section):
    """The GPU jobs' harness (tokenmill/jobs/): operational."""

    raw: dict = field(repr=False, compare=False)
    lock_wait_s: float
    lock_poll_s: float
    heartbeat_s: float
    preemption_watch: bool
    preemption_watch_s: float


def _categories(raw: Mapping) -> Mapping[str, CategorySettings]:
    return MappingProxyType({name: CategorySettings.from_raw(c) for name, c in raw.items()})


@dataclass(frozen=True)
class Settings:
    """The whole resolved config. `raw` is the validated dict (defaults filled in)."""

    raw: dict = field(repr=False, compare=False)
    results_dir: str
    journal_dir: str
    tokenizer: TokenizerSettings
    max_prompt_tokens: int
    categories: Mapping[str, CategorySettings]
    generation: GenerationSettings
    reproduce: str | None
    dataset: DatasetSettings
    reject_limits: RejectLimitsSettings
    hidden_states: HiddenStatesSettings
    jobs: JobsSettings

    @classmethod
    def from_config(cls, config: Mapping) -> Settings:
        """Validate (a copy of) `config` against the schema, fill defaults, build settings."""
        return cls.from_validated(validate_schema(copy.deepcopy(dict(config))))

    @classmethod
    def from_validated(cls, config: Mapping) -> Settings:
        """Settings of a config that validate_schema already checked and filled."""
        raw = copy.deepcopy(dict(config))
        return cls(
            raw=raw,
            results_dir=raw["results_dir"],
            journal_dir=raw["journal_dir"],
            tokenizer=TokenizerSettings.from_raw(raw["tokenizer"]),
            max_prompt_tokens=raw["max_prompt_tokens"],
            categories=_categories(raw["categories"]),
            generation=GenerationSettings.from_raw(raw["generation"]),
            reproduce=raw["reproduce"],
            dataset=DatasetSettings.from_raw(raw["dataset"]),
            reject_limits=RejectLimitsSettings.from_raw(raw["reject_limits"]),
            hidden_states=HiddenStatesSettings.from_raw(raw["hidden_states"]),
            jobs=JobsSettings.from_raw(raw["jobs"]),
        )

    def resources(self, category: str | None = None) -> ResourceSettings:
        """A category's effective generate-job resources (generation.resources with the
        category's overrides); generation.resources for None."""
        return effective_resources(self.generation, self.categories.get(category))


def effective_resources(
    generation: GenerationSettings, category: CategorySettings | None = None
) -> ResourceSettings:
    """generation.resources with the overrides of a category's `resources` (if any)."""
    merged = {**generation.resources.raw, **thaw((category and category.resources) or {})}
    return ResourceSettings.from_raw(merged)


def hidden_states_resources(
    generation: GenerationSettings, hidden_states: HiddenStatesSettings
) -> ResourceSettings:
    """The hidden_states jobs' resources: generation.resources with hidden_states.resources."""
    return ResourceSettings.from_raw(
        {**generation.resources.raw, **thaw(hidden_states.resources or {})}
    )


def as_settings(config: Settings | Mapping) -> Settings:
    """`config` itself if it is Settings, else the Settings of the (validated) dict."""
    return config if isinstance(config, Settings) else Settings.from_config(config)


def as_section(value, section: str):
    """`value` itself if it is already the section's settings object, else load_section."""
    return value if isinstance(value, _section_class(section)) else load_section(value, section)


def _section_class(section: str):
    if section.startswith("categories."):
        return CategorySettings
    return _SECTION_CLASSES[section]


_SECTION_CLASSES = {
    "tokenizer": TokenizerSettings,
    "generation": GenerationSettings,
    "dataset": DatasetSettings,
    "reject_limits": RejectLimitsSettings,
    "hidden_states": HiddenStatesSettings,
    "jobs": JobsSettings,
}


def normalize_source(src, category: Mapping) -> dict:
    """A source as a dict: {path, format} or {hub, config, split, revision, format}."""
    spec = {"path": src} if isinstance(src, str) else dict(src)
    spec.setdefault("format", category["format"])
    return spec

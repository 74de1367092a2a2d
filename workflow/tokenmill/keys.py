"""Generation fingerprint and sample keys: what makes a generated sample reusable.

A sample is identified by its prompt's token ids and by everything that shapes the engine's
answer (model, revision, sampling, stop tokens, seed policy, the launch command without its
operational flags: launch_flags.py). The Snakefile puts the fingerprint in `params`, so
changing any of these reruns generation and nothing else does; the journal uses sample keys,
so a rerun never pays twice. `material_changes` names what changed between two fingerprints'
materials (the generate job and `tokenmill plan` report it).
"""

from __future__ import annotations

import hashlib

import numpy as np

from tokenmill import contracts, launch_flags
from tokenmill.contracts import canonical_json
from tokenmill.settings import GenerationSettings, load_section


def generation_material(gen) -> dict:
    """Everything in the generation settings that shapes a token, as JSON values: what the
    fingerprint hashes. `gen` is a GenerationSettings, or a generation section as a dict
    (validated here, defaults filled). The launch command keeps only its token-affecting
    arguments (launch_flags.py; `launch.operational_flags` names more operational ones)."""
    if not isinstance(gen, GenerationSettings):
        gen = load_section(gen, "generation")
    raw = gen.raw  # the validated JSON values: the material hashes as it always has
    launch = None
    if gen.managed:
        launch = launch_flags.token_affecting_args(
            list(gen.launch.command or []), gen.launch.operational_flags
        )
    return {
        "engine": gen.engine,
        "model": gen.model,
        "revision": gen.revision,
        "sampling": raw["sampling"],
        "stop_tokens": raw["stop_tokens"],
        "seed_policy": gen.seed_policy,
        "launch": launch,
    }


def generation_fingerprint(gen) -> str:
    """The hash of generation_material(gen)."""
    return hashlib.sha256(canonical_json(generation_material(gen)).encode()).hexdigest()


def material_changes(old: dict, new: dict) -> list[str]:
    """What differs between two generation materials, one line per config key, e.g.
    "generation.launch.command: --dtype float16 -> --dtype bfloat16"."""
    names = {"launch": "launch.command", "sampling": "sampling"}
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if k == "launch" and isinstance(a, list) and isinstance(b, list):
            a, b = _arg_diff(a, b)
        elif isinstance(a, dict) and isinstance(b, dict):
            keys_ = sorted(x for x in set(a) | set(b) if a.get(x) != b.get(x))
            a = canonical_json({x: a.get(x) for x in keys_})
            b = canonical_json({x: b.get(x) for x in keys_})
        out.append(f"generation.{names.get(k, k)}: {_show(a)} -> {_show(b)}")
    return out


def _arg_diff(a: list, b: list) -> tuple[str, str]:
    """The differing middle of two argument lists (common head and tail dropped)."""
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    j = 0
    while j < min(len(a), len(b)) - i and a[-1 - j] == b[-1 - j]:
        j += 1
    # Show the flag a changed value belongs to.
    if i > 0 and a[i : len(a) - j] and b[i : len(b) - j] and not str(a[i]).startswith("-"):
        i -= 1
    return " ".join(a[i : len(a) - j]) or "(none)", " ".join(b[i : len(b) - j]) or "(none)"


def _show(v) -> str:
    return v if isinstance(v, str) else canonical_json(v)


def sample_key(fingerprint: str, prompt_ids) -> str:
    """The key of one sample: sha256(fingerprint ":" prompt ids as little-endian int32)[:32]."""
    data = np.asarray(prompt_ids, dtype="<i4").tobytes()
    return hashlib.sha256(fingerprint.encode() + b":" + data).hexdigest()[:32]


def sample_keys(fingerprint: str, prompts) -> list[str]:
    """sample_key of every row of `prompts`: a list<int32> column (Array or ChunkedArray), or
    its (values, offsets) as contracts.list_arrays gives them. Hashes slices of one buffer."""
    if isinstance(prompts, tuple):
        values, offsets = prompts
    else:
        values, offsets = contracts.list_arrays(prompts)
    buf = memoryview(np.ascontiguousarray(values, dtype="<i4").tobytes())
    base = hashlib.sha256(fingerprint.encode() + b":")
    bounds = (np.asarray(offsets, dtype=np.int64) * 4).tolist()  # Python ints: fast slicing
    out = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        h = base.copy()
        h.update(buf[start:end])
        out.append(h.hexdigest()[:32])
    return out


def sampling_seed(key: str) -> int:
    """Deterministic per-sample seed (fits SGLang's i64 sampling_seed)."""
    return int(key[:15], 16)


# -------------------------------------------------------------------- hidden-state rows


def row_key(input_ids, loss_mask) -> str:
    """The key of one training row in the hidden_states journal: sha256 of its input_ids and
    loss_mask (little-endian int64, a NUL between)[:24]. The row's file is redone when its
    row's key changes."""
    h = hashlib.sha256()
    h.update(np.asarray(input_ids, dtype="<i8").tobytes())
    h.update(b"\0")
    h.update(np.asarray(loss_mask, dtype="<i8").tobytes())
    return h.hexdigest()[:24]


def journal_header(fingerprint: dict) -> str:
    """The first line of a hidden_states shard journal: the stage's fingerprint (model weights,
    layer ids, dtype, backend). A journal with another header is started afresh."""
    return canonical_json({"fingerprint": fingerprint})

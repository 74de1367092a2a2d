"""Generation fingerprint and sample keys: what makes a generated sample reusable.

A sample is identified by its prompt's token ids and by everything that shapes the engine's
answer (model, revision, sampling, stop tokens, seed policy, output-relevant launch flags).
The Snakefile puts the fingerprint in `params`, so changing any of these reruns generation
and nothing else does; the journal uses sample keys, so a rerun never pays twice.
"""

from __future__ import annotations

import hashlib

import numpy as np

from tokenmill import contracts
from tokenmill.contracts import canonical_json

# Launch flags that cannot change what the engine generates (where and how it listens, logs,
# watchdogs). They are left out of the fingerprint; every other flag counts.
OUTPUT_IRRELEVANT_FLAGS = {
    "--host": 1,
    "--port": 1,
    "--log-level": 1,
    "--enable-metrics": 0,
    "--watchdog-timeout": 1,
    "--api-key": 1,
    "--admin-api-key": 1,
}


def _relevant_launch_args(command: list[str]) -> list[str]:
    out, skip = [], 0
    for arg in command:
        if skip:
            skip -= 1
            continue
        flag = arg.split("=", 1)[0]
        if flag in OUTPUT_IRRELEVANT_FLAGS:
            skip = 0 if "=" in arg else OUTPUT_IRRELEVANT_FLAGS[flag]
            continue
        out.append(arg)
    return out


def generation_fingerprint(gen) -> str:
    """The hash of everything in the generation settings that shapes a token. `gen` is a
    GenerationSettings, or a generation section as a dict (validated here, defaults filled)."""
    from tokenmill.settings import GenerationSettings, load_section

    if not isinstance(gen, GenerationSettings):
        gen = load_section(gen, "generation")
    raw = gen.raw  # the validated JSON values: the material hashes as it always has
    material = {
        "engine": gen.engine,
        "model": gen.model,
        "revision": gen.revision,
        "sampling": raw["sampling"],
        "stop_tokens": raw["stop_tokens"],
        "seed_policy": gen.seed_policy,
        "launch": _relevant_launch_args(list(gen.launch.command or [])) if gen.managed else None,
    }
    return hashlib.sha256(canonical_json(material).encode()).hexdigest()


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

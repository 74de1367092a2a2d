"""Kept importable for older callers (config.py): SGLang's API now lives in tokenmill.engines."""

from tokenmill.engines.sglang import (  # noqa: F401
    CLIENT_OWNED_KEYS,
    SAMPLING_KEYS,
    BadResponse,
    SGLangAPI,
    error_message,
    parse_generate,
    skip_tokenizer_init,
    validate_sampling,
)

"""Redaction of secrets (API keys, access tokens) from everything we write or log.

One rule for the whole project: a value is hidden when its key names a credential, when it
follows a credential flag on a command line, or when it equals a known secret's value.
"Token" alone is not a secret here: this project is full of vocabulary tokens
(think_end_token, stop_tokens, max_new_tokens); only credential-style token keys count.
"""

from __future__ import annotations

import re

REDACTED = "<redacted>"
SECRET_FLAGS = ("--api-key", "--admin-api-key", "--hf-token", "--token")
_SECRET_KEY = re.compile(
    r"api[_-]?key|secret|passw(or)?d|credential|authorization"
    r"|^(hf|access|auth|bearer|api|refresh|session)?[_-]?token$",
    re.I,
)


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(key))


def redact(obj, secrets=()):
    """Copy of obj with secret-keyed values, credential flags' values and known secret values
    replaced by REDACTED."""
    secrets = [s for s in secrets if s]
    if isinstance(obj, dict):
        return {
            k: (
                REDACTED
                if is_secret_key(str(k))
                and v not in (None, "", False)
                and not isinstance(v, dict | list)
                else redact(v, secrets)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        return redact_argv(list(obj), secrets)
    if isinstance(obj, str):
        for s in secrets:
            obj = obj.replace(s, REDACTED)
        return obj
    return obj


def redact_argv(argv: list, secrets=()) -> list:
    """A list (an argv, typically): the value after a credential flag is hidden too."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if isinstance(arg, str):
            flag, eq, _ = arg.partition("=")
            if flag in SECRET_FLAGS:
                out.append(f"{flag}={REDACTED}" if eq else arg)
                hide_next = not eq
                continue
        out.append(redact(arg, secrets))
    return out

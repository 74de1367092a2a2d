from tokenmill.redaction import REDACTED, is_secret_key, redact


def test_credentials_are_secret_vocabulary_tokens_are_not():
    for key in ("api_key", "admin-api-key", "hf_token", "token", "access_token", "password"):
        assert is_secret_key(key), key
    for key in (
        "think_end_token",
        "stop_tokens",
        "max_new_tokens",
        "tokenizer_path",
        "max_total_num_tokens",
        "skip_tokenizer_init",
    ):
        assert not is_secret_key(key), key


def test_redact_keys_flags_and_values():
    obj = {
        "api_key": "sk-123",
        "dataset": {"think_end_token": "</think>"},
        "argv": ["serve", "--api-key", "sk-123", "--admin-api-key=sk-9", "--port", "1"],
        "log": "started with key sk-123",
    }
    out = redact(obj, secrets=["sk-123"])
    assert out["api_key"] == REDACTED
    assert out["dataset"] == {"think_end_token": "</think>"}
    assert out["argv"] == [
        "serve",
        "--api-key",
        REDACTED,
        f"--admin-api-key={REDACTED}",
        "--port",
        "1",
    ]
    assert "sk-123" not in str(out)

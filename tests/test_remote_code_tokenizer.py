"""A tokenizer that ships its own code (as Kimi's tiktoken tokenizer does: tokenization_kimi.py
loaded through `auto_map` with trust_remote_code), loaded and used by the real tokenize stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from tokenmill import contracts
from tokenmill.prepare import formats
from tokenmill.testing.tiny_model import KIMI_SPECIAL, THINK_TOKENS, template_text

BIN = Path(sys.executable).parent

# A slow, pure-Python tokenizer: one token per byte, plus the chat template's special tokens.
TOKENIZER_CODE = """
from transformers import PreTrainedTokenizer

SPECIAL = {special!r}
ADDED = {added!r}


class ByteTokenizer(PreTrainedTokenizer):
    vocab_files_names = {{}}

    def __init__(self, **kwargs):
        self._vocab = {{chr(i): i for i in range(256)}}
        kwargs.setdefault("eos_token", "<|im_end|>")
        super().__init__(**kwargs)
        self.add_special_tokens({{"additional_special_tokens": SPECIAL}})
        self.add_tokens(ADDED)

    @property
    def vocab_size(self):
        return 256

    def get_vocab(self):
        return {{**self._vocab, **self.added_tokens_encoder}}

    def _tokenize(self, text, **kwargs):
        return list(text.encode("utf-8").decode("latin-1"))

    def _convert_token_to_id(self, token):
        return self._vocab[token]

    def _convert_id_to_token(self, index):
        return chr(index)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
"""


def make_remote_code_tokenizer(path: Path) -> Path:
    path.mkdir(parents=True)
    code = TOKENIZER_CODE.format(special=KIMI_SPECIAL, added=THINK_TOKENS)
    (path / "tokenization_bytetok.py").write_text(code)
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "ByteTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_bytetok.ByteTokenizer", None]},
                "eos_token": "<|im_end|>",
            }
        )
    )
    (path / "chat_template.jinja").write_text(template_text("kimi"))
    return path


def run_tokenize(tmp_path: Path, tok_dir: Path, trust: bool) -> subprocess.CompletedProcess:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    pid = formats.prompt_id(messages, None)
    prompts = tmp_path / "prompts.parquet"
    table = {"prompt_id": [pid], "source": ["t:1"], "messages": [json.dumps(messages)],
             "tools": [None]}  # fmt: skip
    import pyarrow as pa

    contracts.write_table(pa.table(table), prompts, contracts.PROMPTS, "prepare")
    cfg = {"path": str(tok_dir), "trust_remote_code": trust, "chat_template_kwargs": {}}
    return subprocess.run(
        [str(BIN / "tokenmill"), "tokenize", "--prompts", str(prompts), "--category", "c",
         "--shards", "1", "--shard-by", "prompt_id", "--tokenizer-config", json.dumps(cfg),
         "--max-prompt-tokens", "4096",
         "--out-dir", str(tmp_path / "out"), "--rejected", str(tmp_path / "rej.parquet")],
        capture_output=True, text=True, timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": str(BIN)},
    )  # fmt: skip


def test_trust_remote_code_tokenizer_tokenizes(tmp_path):
    tok_dir = make_remote_code_tokenizer(tmp_path / "tok")
    proc = run_tokenize(tmp_path, tok_dir, trust=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (ids,) = pq.read_table(tmp_path / "out" / "000.parquet")["prompt_ids"].to_pylist()
    # Byte tokens (the remote code's own tokenization), ending with the <think> of the template.
    assert bytes(i for i in ids if i < 256).decode().count("capital of France") == 1
    think_id = 256 + len(KIMI_SPECIAL) + THINK_TOKENS.index("<think>")
    assert ids[-1] == think_id


def test_remote_code_refused_without_trust(tmp_path):
    tok_dir = make_remote_code_tokenizer(tmp_path / "tok")
    proc = run_tokenize(tmp_path, tok_dir, trust=False)
    assert proc.returncode != 0
    assert "trust_remote_code" in proc.stdout + proc.stderr

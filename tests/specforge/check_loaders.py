"""Run by tests/test_trainer_loaders.py with the python of tests/specforge/ensure_venv.sh.

Uses SGLang SpecForge's own code only: its pre-tokenized prompt loader (data.prompts_path), its
vocab-mapping file generator, an EAGLE-3 draft model's load_vocab_mapping and its consistency
check. Argument: a JSON spec {export, out, max_length, draft_sizes, target_vocab_size,
mappings}. Writes rows.json (the rows as SpecForge loaded them) and, per draft size N,
d2t-N.npy and t2d-N.npy from its own vocab_mapping .pt. Raises if SpecForge rejects one of ours.
"""

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")  # flash_attn missing: irrelevant here

from datasets import Dataset  # noqa: E402
from specforge.core.compact_teacher import validate_vocab_mapping_consistency  # noqa: E402
from specforge.data.preprocessing import generate_vocab_mapping_file  # noqa: E402
from specforge.data.prompt_builder import prepare_prompt_tasks  # noqa: E402
from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: E402
from transformers import LlamaConfig  # noqa: E402


def draft_model(draft_size, target_vocab_size):
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=64,
        vocab_size=target_vocab_size,
    )
    config.draft_vocab_size = draft_size
    return LlamaForCausalLMEagle3(config)


def main():
    spec = json.loads(sys.argv[1])
    out = Path(spec["out"])
    target = spec["target_vocab_size"]
    prompts = prepare_prompt_tasks(
        spec["export"],
        None,  # no tokenizer: pre-tokenized rows never touch one
        chat_template=None,
        max_length=spec["max_length"],
        is_preformatted=False,
        train_only_last_turn=False,
        cache_dir=None,
        cache_key=None,
        num_proc=None,
        min_loss_tokens=1,
    )
    rows = [p["payload"] for p in prompts]
    (out / "rows.json").write_text(json.dumps(rows))
    ds = Dataset.from_list(rows).with_format("torch")
    for n in spec["draft_sizes"]:
        path = generate_vocab_mapping_file(ds, target, n, str(out), f"theirs-{n}")
        mapping = torch.load(path)
        np.save(out / f"d2t-{n}.npy", mapping["d2t"].numpy())
        np.save(out / f"t2d-{n}.npy", mapping["t2d"].numpy())

    for folder in spec["mappings"]:
        path = Path(folder) / "vocab_mapping.pt"
        raw = torch.load(path)  # what load_vocab_mapping reads (weights_only by default)
        assert sorted(raw) == ["d2t", "t2d"], sorted(raw)
        assert raw["d2t"].dtype == torch.int64 and raw["t2d"].dtype == torch.bool
        model = draft_model(raw["d2t"].numel(), target)
        model.load_vocab_mapping(str(path))
        assert model.vocab_mapping_loaded
        validate_vocab_mapping_consistency(model.t2d, model.d2t)
        assert torch.equal(model.d2t, raw["d2t"]) and torch.equal(model.t2d, raw["t2d"])
    print("specforge: ok")


if __name__ == "__main__":
    main()

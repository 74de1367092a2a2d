"""A tiny tokenizer and causal LM built offline, for the demo and the tests.

Nothing can be downloaded from the Hugging Face hub on our machines, so the demo model in
sample/model and every test fixture come from here:

- a byte-level BPE tokenizer trained with the `tokenizers` library on a fixed built-in corpus,
  with the special tokens of Kimi-K2.5-shaped and Qwen3-shaped chat templates;
- a 2-layer Qwen2 causal LM, randomly initialised with a fixed seed and then briefly trained on
  synthetic conversations so that, greedy, it answers with `reasoning</think>answer<|im_end|>`:
  outputs then end with the stop token and contain the think-close token, like a real
  thinking model's. Everything is seeded: the same call gives the same files.

`tokenmill make-tiny-model DIR [--template kimi|qwen3] [--train-steps N]` writes one.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

KIMI_SPECIAL = [
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "[EOS]",
    "[BOS]",
]
QWEN_SPECIAL = ["<|im_start|>", "<|endoftext|>"]
# Added (not "special") so that decoding keeps them, as real thinking models do.
THINK_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

_CORPUS = """
The quick brown fox jumps over the lazy dog. A user asks a question and the assistant answers.
def add(a, b):\n    return a + b\n\nclass Stack:\n    def __init__(self):\n        self.items = []
for i in range(10):\n    print(i * i)\nimport json\nwith open("data.json") as f:\n    data = json.load(f)
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters":
{"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
Please write a function that reverses a string. Explain how binary search works.
What is the capital of France? The capital of France is Paris. Translate hello into Spanish: hola.
Summarize the following text in one sentence. Let me think about this step by step.
The answer is 42. First, we compute the sum. Then we divide by the count to get the mean.
SELECT name, COUNT(*) FROM users GROUP BY name ORDER BY 2 DESC; fn main() { println!("hi"); }
You are a helpful assistant with access to the following functions. Use them if required.
The function returned a result. Based on the tool output, the temperature is 21 degrees.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.718 -1 +1 = < > ( ) [ ] { } ; : , . ! ? ' "
"""

# Synthetic (question, reasoning, answer) triples the tiny model is trained on.
_QA = [
    ("What is 2 plus 2?", "Add the numbers.", "4"),
    ("Name a color.", "Pick one.", "Blue."),
    ("Write a function that adds two numbers.", "Use def.", "def add(a, b): return a + b"),
    ("What is the capital of France?", "Recall geography.", "Paris."),
    ("Say hello in Spanish.", "Translate.", "Hola."),
    ("Explain binary search.", "Halve the range.", "Split the sorted list in half."),
    ("What is the weather in Paris?", "Call the tool.", "It is sunny."),
    ("Reverse the string abc.", "Read it backwards.", "cba"),
]


def template_text(name: str) -> str:
    return (resources.files("tokenmill.testing") / "templates" / f"{name}_like.jinja").read_text()


def build_tiny_tokenizer(out_dir, template: str = "kimi", vocab_size: int = 1024):
    """Train and save a byte-level BPE tokenizer with a chat template. Returns the HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = KIMI_SPECIAL + QWEN_SPECIAL
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.strip().splitlines() if line]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    tok.add_tokens(THINK_TOKENS)
    eos = "<|im_end|>" if template == "kimi" else "<|im_end|>"
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token="<|endoftext|>",
        bos_token="[BOS]",
        model_max_length=4096,
    )
    hf.chat_template = template_text(template)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    return hf


def _training_sequences(tokenizer) -> list[list[int]]:
    import random

    # Random prompts made of corpus words teach the model to stop on any input.
    rng = random.Random(0)
    words = _CORPUS.split()
    generic = [
        (" ".join(rng.choice(words) for _ in range(rng.randint(3, 16))), "Hmm.", "Done.")
        for _ in range(24)
    ]
    seqs = []
    for question, reasoning, answer in _QA + generic:
        for system in (None, "Be brief."):
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": question}
            ]
            prompt = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                thinking=True,
            )
            answer_ids = tokenizer.encode(f"{reasoning}</think>{answer}<|im_end|>")
            seqs.append(list(prompt) + answer_ids)
    return seqs


def build_tiny_model(out_dir, template: str = "kimi", train_steps: int = 300, seed: int = 0):
    """Tokenizer + a 2-layer Qwen2 LM, trained `train_steps` steps so it learns to stop."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer(out, template=template)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ... (not 16).
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        eos_token_id=eos_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("[BOS]"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if train_steps:
        _train(model, _training_sequences(tokenizer), train_steps, tokenizer.pad_token_id)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenmill_tiny.json").write_text(
        json.dumps({"template": template, "train_steps": train_steps, "seed": seed}) + "\n"
    )
    return out


def _train(model, seqs, steps: int, pad_id: int) -> None:
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill make-tiny-model", description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--template", choices=["kimi", "qwen3", "chatml"], default="kimi")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--tokenizer-only", action="store_true")
    args = parser.parse_args(argv)
    if args.tokenizer_only:
        build_tiny_tokenizer(args.out_dir, template=args.template)
    else:
        build_tiny_model(args.out_dir, template=args.template, train_steps=args.train_steps)
    print(f"wrote {args.out_dir}")
    return 0

"""A tiny word-level tokenizer and a matching random Llama, built offline inside the tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

CORPUS = [
    "Review: a charming and often affecting journey .",
    "Sentiment (positive or negative): positive negative",
    "Question: Which technology was developed most recently? Answer: cellular telephone",
    "television refrigerator airplane yes no",
    "A man is sitting on a roof . he starts pulling up roofing",
    "a b c d e f g h the of to is was",
    "zzzzzzzzzzzzzzzzzzzz",
]
SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]


def tiny_tokenizer(extra: list[str] | None = None):
    """A ``PreTrainedTokenizerFast`` over a word-level model: one token per word or punctuation
    mark (leading spaces carry no token), no BOS added, EOS ``<eos>``, pad ``<pad>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1)
    tok.train_from_iterator(CORPUS + list(extra or []), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
        eos_token="<eos>",
    )


def tiny_model(tokenizer, seed: int = 0, dtype=torch.float32):
    """A random 2-block Llama whose vocabulary matches ``tokenizer`` (eval mode, frozen)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.requires_grad_(False)
    return model


WORDS = "a charming and often affecting journey the of to is was b c d e f g h".split()
SENTIMENT_TEMPLATE = "Review: {question}\nSentiment (positive or negative):"


def save_tiny_model(folder: Path) -> Path:
    """A tiny model and its tokenizer saved as an ordinary Hugging Face folder."""
    tok = tiny_tokenizer()
    tiny_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def write_sentiment_task(path: Path, n: int, rng: random.Random, id_prefix: str = "x") -> Path:
    """``n`` random SST-2-like rows (label: whether the first word is one of the first eight)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            words = rng.choices(WORDS, k=rng.randint(3, 8))
            row = {"id": f"{id_prefix}{i}", "question": " ".join(words), "passage": None,
                   "choices": ["negative", "positive"], "label": int(words[0] in WORDS[:8])}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return path


def save_model_and_task(root: Path, n: int, seed: int = 0) -> Path:
    """``root/model`` (:func:`save_tiny_model`) and ``root/task.jsonl`` with ``n`` rows."""
    save_tiny_model(root / "model")
    write_sentiment_task(root / "task.jsonl", n, random.Random(seed))
    return root


def tiny_cli_args(root: Path) -> list[str]:
    """The ``loca`` flags that point at :func:`save_model_and_task`'s folder, on the CPU, r = k = 4."""
    return ["--model", str(root / "model"), "--task", str(root / "task.jsonl"),
            "--template", SENTIMENT_TEMPLATE, "--device", "cpu",
            "--rank", "4", "--feedback-rank", "4"]  # fmt: skip

"""Tiny random models and synthetic token sequences for engine tests (no tokenizer, no network)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from loca.data.batching import Encoded
from loca.models.parts import find_parts

VOCAB = 97


def tiny_llama(seed: int = 0, layers: int = 3, hidden: int = 32, dtype=torch.float64):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    model.requires_grad_(False)
    return model, find_parts(model)


def sequences(n: int, seed: int = 0, answers: int = 2, eos: int = 1) -> list[Encoded]:
    """A learnable synthetic task: the answer token is a function of the prompt's first token."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (1,), generator=gen))
        prompt = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
        answer = 3 + (prompt[0] % answers)
        out.append(Encoded(tuple(prompt), (answer, eos), has_eos=True))
    return out

"""Generate text with the frozen model, or with LoCA adapters attached (greedy, KV cache on).

Example::

    loca generate --adapter runs/sst2/adapter --prompt "Review: a charming film
    Sentiment (positive or negative):"

``--chat`` wraps the prompt in the model's chat template as a user turn. ``--compare`` also
prints the frozen model's continuation, for a side-by-side look.
"""

from __future__ import annotations

import argparse

import torch

from ..method.adapters import from_pretrained
from ..models.parts import load_model
from .args import adapter_config, add_model_args, add_output_args, model_from_adapter


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--adapter", default=None, help="folder of saved LoCA adapters to attach")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--compare", action="store_true", help="also print the frozen model's continuation")
    add_output_args(p)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    m, revision = model_from_adapter(args, adapter_config(args))  # the adapter's base model
    model, tokenizer = load_model(
        m.model,
        device=m.device,
        dtype=m.dtype,
        random_init=m.random_init,
        trust_remote_code=m.trust_remote_code,
        revision=revision,
    )
    text = args.prompt
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"--chat: the tokenizer of {m.model} has no chat template")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    ids = tokenizer(text, return_tensors="pt").input_ids.to(model.device)
    adapters = from_pretrained(model, args.adapter) if args.adapter else None
    try:
        outputs = {"loca" if adapters else "frozen": continuation(model, tokenizer, ids, args.max_new_tokens)}
        if adapters and args.compare:
            with adapters.disable_adapter():
                outputs["frozen"] = continuation(model, tokenizer, ids, args.max_new_tokens)
    finally:
        if adapters is not None:
            adapters.unload()
    for name, out in outputs.items():
        print(f"[{name}] {out}")
    return 0


@torch.inference_mode()
def continuation(model, tokenizer, ids: torch.Tensor, max_new_tokens: int) -> str:
    """Greedy continuation of ``ids`` (KV cache on), decoded without special tokens."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=pad,
        attention_mask=torch.ones_like(ids),
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

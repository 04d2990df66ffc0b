"""Generate text with the frozen model, or with LoCA adapters attached (greedy, KV cache on).

Example::

    loca generate --adapter runs/sst2/adapter --prompt "Review: a charming film
    Sentiment (positive or negative):"

``--chat`` wraps the prompt in the model's chat template as a user turn. ``--compare`` also
prints the frozen model's continuation, for a side-by-side look. ``--max-new-tokens`` is capped
at what the model's context leaves after the prompt (with a message); an empty prompt is refused,
and so is a generation whose logits turn NaN (naming the likely cause).
"""

from __future__ import annotations

import argparse
import logging

import torch

from ..method.adapters import from_pretrained
from ..models.parts import context_length, load_model
from .args import adapter_config, add_model_args, add_output_args, model_from_adapter

log = logging.getLogger("loca")


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
    if not args.prompt:
        raise ValueError('--prompt is empty: give the text to continue, e.g. --prompt "Once upon a time"')
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
    if ids.shape[1] == 0:
        raise ValueError(f"--prompt {args.prompt!r} gives no token with the tokenizer of {m.model}")
    new_tokens = cap_new_tokens(args.max_new_tokens, ids.shape[1], context_length(model))
    adapters = from_pretrained(model, args.adapter) if args.adapter else None
    try:
        name = "loca" if adapters else "frozen"
        outputs = {name: checked_continuation(model, tokenizer, ids, new_tokens, name)}
        if adapters and args.compare:
            with adapters.disable_adapter():
                outputs["frozen"] = checked_continuation(model, tokenizer, ids, new_tokens, "frozen")
    finally:
        if adapters is not None:
            adapters.unload()
    for name, out in outputs.items():
        print(f"[{name}] {out}")
    return 0


def cap_new_tokens(wanted: int, prompt_tokens: int, context: int | None) -> int:
    """``wanted`` new tokens, or as many as the model's ``context`` leaves after the prompt (with
    a logged message); a prompt that fills the context is refused. No context known: ``wanted``."""
    if context is None:
        return wanted
    room = context - prompt_tokens
    if room < 1:
        raise ValueError(
            f"the prompt takes {prompt_tokens} tokens, the model's whole context of {context}: "
            "shorten --prompt"
        )
    if wanted > room:
        log.warning(
            f"--max-new-tokens {wanted} capped at {room}: the model's context is {context} tokens "
            f"and the prompt takes {prompt_tokens}"
        )
        return room
    return wanted


class NaNLogits(ValueError):
    """A generation step gave NaN logits."""


def refuse_nan():
    """A logits processor that passes the scores through unchanged and raises
    :class:`NaNLogits` at the first step whose scores hold a NaN."""
    from transformers import LogitsProcessor  # imported when generating: `loca` starts fast

    class RefuseNaN(LogitsProcessor):
        def __init__(self) -> None:
            self.step = 0

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if torch.isnan(scores).any():
                raise NaNLogits(f"the logits of generated token {self.step + 1} are NaN")
            self.step += 1
            return scores

    return RefuseNaN()


def checked_continuation(model, tokenizer, ids: torch.Tensor, max_new_tokens: int, name: str) -> str:
    """:func:`continuation`, with NaN logits an error that names the likely cause."""
    try:
        return continuation(model, tokenizer, ids, max_new_tokens)
    except NaNLogits as exc:
        raise ValueError(f"the {name} model: {exc}; {nan_cause(model, name)}") from None


def nan_cause(model, name: str) -> str:
    """The likely source of NaN logits: a non-finite weight (named), else an overflow."""
    for what, tensors in (("weight", model.named_parameters()), ("buffer", model.named_buffers())):
        for key, t in tensors:
            if t.is_floating_point() and not torch.isfinite(t).all():
                return (
                    f"its {what} {key} holds NaN/Inf: the checkpoint is damaged (download or save it again)"
                )
    dtype = next(model.parameters()).dtype
    wide = dtype not in (torch.float16, torch.bfloat16)
    if name == "loca":
        return (
            f"its weights and the adapter are finite, so the adapter drives the {dtype} activations "
            "to overflow: " + ("" if wide else "try --dtype float32, or ") + "generate without --adapter "
            "to compare"
        )
    if wide:
        return f"its weights are finite but its {dtype} activations overflow: check the checkpoint"
    return f"its weights are finite, so the {dtype} activations overflow: try --dtype float32"


@torch.inference_mode()
def continuation(model, tokenizer, ids: torch.Tensor, max_new_tokens: int) -> str:
    """Greedy continuation of ``ids`` (KV cache on), decoded without special tokens; raises
    :class:`NaNLogits` when a step's logits are NaN (greedy decoding would pick token 0)."""
    from transformers import LogitsProcessorList

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=pad,
        attention_mask=torch.ones_like(ids),
        logits_processor=LogitsProcessorList([refuse_nan()]),
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

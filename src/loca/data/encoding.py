"""Tokenise a task's examples: gold completions (for CE and training) and every choice (ranking).

Both go through :func:`loca.data.batching.encode`, so prompts lose tokens from the left when a
sequence is too long and answer tokens are never cut. ``n_chars`` is the length in characters of
the choice text *without* the leading space (the lm-evaluation-harness ``acc_norm`` convention).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import replace

from .batching import Encoded, TruncationError, encode, truncate_prompt
from .schema import Example
from .tasks import Task


def _encode(
    tokenizer, task: Task, ex: Example, choice: int, max_length: int, add_eos: bool, source: int
) -> Encoded:
    try:
        enc = encode(
            tokenizer,
            task.prompt(ex),
            task.completion(ex, choice),
            max_length=max_length,
            add_eos=add_eos,
            source=source,
            choice=choice,
        )
    except TruncationError as exc:
        raise TruncationError(f"example {ex.id!r}, choice {choice}: {exc}") from None
    return enc


def encode_examples(
    tokenizer, task: Task, examples: Sequence[Example], max_length: int, add_eos: bool
) -> list[Encoded]:
    """One sequence per example: prompt + gold completion (+ EOS when ``add_eos``).

    ``source`` is the example's index in ``examples`` and ``choice`` its label.
    """
    return [_encode(tokenizer, task, ex, ex.label, max_length, add_eos, i) for i, ex in enumerate(examples)]


def encode_choices(
    tokenizer,
    task: Task,
    examples: Sequence[Example],
    max_length: int,
    *,
    eos_on_gold: bool = False,
) -> list[Encoded]:
    """One sequence per (example, choice), without EOS, for ranking accuracy.

    When a prompt must be truncated, every choice of the example keeps the same (shortest
    needed) prompt suffix, so all choices are scored in the same context. With
    ``eos_on_gold`` the gold choice's sequence ends in EOS (so one pass gives its CE with EOS
    as well; ranking scores leave the EOS out).
    """
    out: list[Encoded] = []
    for i, ex in enumerate(examples):
        encs = [
            _encode(tokenizer, task, ex, c, max_length, eos_on_gold and c == ex.label, i)
            for c in range(len(ex.choices))
        ]
        keep = min(len(e.prompt) for e in encs)
        bos = tokenizer.bos_token_id
        out.extend(replace(e, prompt=truncate_prompt(e.prompt, keep, bos)) for e in encs)
    return out


def count_truncated(tokenizer, task: Task, examples: Sequence[Example], encoded: Sequence[Encoded]) -> int:
    """How many of ``encoded`` (one per example, as from :func:`encode_examples`) lost prompt
    tokens to truncation."""
    prompts = [task.prompt(ex) for ex in examples]
    full = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    return sum(len(f) > len(e.prompt) for f, e in zip(full, encoded, strict=True))


def content_fingerprint(*groups: Sequence[Encoded]) -> str:
    """A SHA-256 over the token content of encoded sequences, group by group (e.g. the training
    and held-out sequences): each sequence's prompt and completion ids and its EOS flag, in order.
    Any change to what a fit sees (a flipped label, an edited question, another tokenizer, another
    ``max_length`` or ``add_eos``, an example moved between groups) changes it; ids do not enter."""
    digest = hashlib.sha256()
    for items in groups:
        digest.update(f"group of {len(items)}\n".encode())
        for e in items:
            digest.update(json.dumps([list(e.prompt), list(e.completion), e.has_eos]).encode() + b"\n")
    return digest.hexdigest()

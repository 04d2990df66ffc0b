"""Tokenisation of (prompt, completion) pairs and length-grouped batches with predict positions.

A predict position is a position t whose *next* token belongs to the completion; only those carry
loss. Over-long inputs lose prompt tokens from the left; answer tokens are never cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


class TruncationError(ValueError):
    """The completion alone does not fit the maximum length."""


@dataclass(frozen=True)
class Encoded:
    """Token ids of one sequence: ``prompt + completion`` (the completion may end with EOS)."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    has_eos: bool = False
    source: int = -1  # index of the item this sequence belongs to (for ranking), -1 if unused
    choice: int = -1
    n_chars: int = 0  # characters of the completion text without its leading space (acc_norm)

    @property
    def ids(self) -> tuple[int, ...]:
        return self.prompt + self.completion


def encode(
    tokenizer,
    prompt: str,
    completion: str,
    *,
    max_length: int,
    add_eos: bool,
    source: int = -1,
    choice: int = -1,
) -> Encoded:
    """Tokenise prompt and completion separately and left-truncate the prompt to fit.

    The prompt keeps at least one token, since the position that predicts the first answer token
    is the last prompt position.
    """
    p_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    c_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    has_eos = add_eos and tokenizer.eos_token_id is not None
    if has_eos:
        c_ids.append(tokenizer.eos_token_id)
    if not c_ids:
        raise TruncationError(f"completion {completion!r} tokenises to nothing")
    if not p_ids:
        raise TruncationError(f"prompt {prompt[:60]!r} tokenises to nothing")
    budget = max_length - len(c_ids)
    if budget < 1:
        raise TruncationError(
            f"completion {completion[:60]!r} ({len(c_ids)} tokens) leaves no room for the prompt "
            f"within max_length={max_length}; raise max_length"
        )
    p_ids = truncate_prompt(p_ids, budget, tokenizer.bos_token_id)
    return Encoded(tuple(p_ids), tuple(c_ids), has_eos, source, choice, len(completion.lstrip()))


def truncate_prompt(ids: Sequence[int], length: int, bos_id: int | None) -> tuple[int, ...]:
    """The last ``length`` prompt tokens; a leading BOS the tokenizer added is kept in front."""
    ids = tuple(ids)
    if len(ids) <= length:
        return ids
    if bos_id is not None and ids and ids[0] == bos_id and length >= 2:
        return (ids[0],) + ids[len(ids) - length + 1 :]
    return ids[len(ids) - length :]


@dataclass
class Batch:
    """A right-padded batch and its predict positions (``pos_b``, ``pos_t``) and targets."""

    input_ids: Tensor  # B×T
    attention_mask: Tensor | None  # B×T; None: no padding (as CUDA graphs take an unpadded batch)
    pos_b: Tensor  # N
    pos_t: Tensor  # N
    targets: Tensor  # N, the next token at each predict position
    is_eos: Tensor  # N, bool: the target is the appended EOS
    items: list[Encoded]

    @property
    def n_positions(self) -> int:
        return int(self.targets.numel())

    @property
    def roles(self) -> Tensor:
        """Each predict position's role (:data:`ROLES`), on the batch's device."""
        return position_roles(self.pos_b, self.is_eos)

    def to(self, device: torch.device | str) -> Batch:
        move = lambda t: t if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(
            move(self.input_ids),
            move(self.attention_mask),
            move(self.pos_b),
            move(self.pos_t),
            move(self.targets),
            move(self.is_eos),
            self.items,
        )


ROLES = ("first", "inside", "eos")  # what a predict position predicts: see position_roles


def position_roles(pos_b: Tensor, is_eos: Tensor) -> Tensor:
    """The role of each predict position (an index into :data:`ROLES`): 0 = it predicts its
    completion's first token (the prompt's last position), 2 = it predicts the appended EOS,
    1 = any other completion token. ``pos_b`` lists each sequence's positions together and in
    order (as :func:`collate` makes them), so a position is first when its row differs from the
    previous position's. Pure tensor ops: a CUDA graph can capture it."""
    first = torch.ones_like(pos_b, dtype=torch.bool)
    first[1:] = pos_b[1:] != pos_b[:-1]
    inside = torch.ones_like(pos_b)
    return torch.where(is_eos, inside + 1, torch.where(first, inside - 1, inside))


def collate(items: Sequence[Encoded], pad_id: int) -> Batch:
    width = max(len(it.ids) for it in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    pos_b, pos_t, targets, is_eos = [], [], [], []
    for row, it in enumerate(items):
        seq = it.ids
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        n_p, n_c = len(it.prompt), len(it.completion)
        for j in range(n_c):
            pos_b.append(row)
            pos_t.append(n_p - 1 + j)
            targets.append(it.completion[j])
            is_eos.append(it.has_eos and j == n_c - 1)
    return Batch(
        ids,
        mask,
        torch.tensor(pos_b),
        torch.tensor(pos_t),
        torch.tensor(targets),
        torch.tensor(is_eos, dtype=torch.bool),
        list(items),
    )


def make_batches(
    items: Sequence[Encoded], pad_id: int, batch_size: int = 16, max_tokens: int | None = None
) -> list[Batch]:
    """Group sequences of similar length (sorted, stable) into batches of at most ``batch_size``
    sequences and, if given, ``max_tokens`` padded tokens. Order is deterministic."""
    if not items:
        raise ValueError("no sequences to batch")
    order = sorted(range(len(items)), key=lambda i: (len(items[i].ids), i))
    batches, current = [], []
    for i in order:
        width = len(items[i].ids)
        too_many = len(current) >= batch_size
        too_wide = max_tokens is not None and current and (len(current) + 1) * width > max_tokens
        if current and (too_many or too_wide):
            batches.append(collate(current, pad_id))
            current = []
        current.append(items[i])
    batches.append(collate(current, pad_id))
    return batches


def padding_fraction(batches: Sequence[Batch]) -> float:
    """Share of padded positions over all positions in the batches."""
    total = sum(b.attention_mask.numel() for b in batches)
    real = sum(int(b.attention_mask.sum()) for b in batches)
    return 1.0 - real / total if total else 0.0


def pad_token_id(tokenizer) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if tid is not None:
            return int(tid)
    return 0

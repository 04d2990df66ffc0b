"""Synthetic token sequences of a stated length, for time and memory runs with no data at hand."""

from __future__ import annotations

import torch

from .batching import Encoded


def synthetic_items(
    n: int, length: int, vocab: int, seed: int = 0, eos_id: int | None = None
) -> list[Encoded]:
    """``n`` sequences of exactly ``length`` tokens, drawn uniformly from ids ``0..vocab-1``
    (seeded): the last token is the completion (followed by ``eos_id`` inside the length when
    given), the rest the prompt — one or two predict positions per sequence, as in SST-2."""
    answer = 2 if eos_id is not None else 1
    if n < 1 or length < answer + 1 or vocab < 2:
        raise ValueError(
            f"synthetic sequences need n ≥ 1, length ≥ {answer + 1} and a vocabulary "
            f"(got n={n}, length={length}, vocab={vocab})"
        )
    ids = torch.randint(vocab, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()
    items = []
    for i, row in enumerate(ids):
        if eos_id is None:
            items.append(Encoded(tuple(row[:-1]), (row[-1],), source=i))
        else:
            items.append(Encoded(tuple(row[:-2]), (row[-2], eos_id), has_eos=True, source=i))
    return items

"""Per-block tensors kept as slices of one buffer per device, so that stacking them is free.

A Stage II pass works on all blocks of a device at once (one batched matmul or solve); its
constant inputs (A, the feedback factors) and B are stored as consecutive slices of one tensor
per device (:func:`pack`), and :func:`stack` / :func:`cat` hand such slices back as a *view* of
that buffer instead of a copy. Any other tensors are copied, exactly as ``torch.stack`` /
``torch.cat`` would, so callers never depend on the layout for correctness, only for memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def pack(
    tensors: Sequence[Tensor], devices: Sequence[torch.device], dtype: torch.dtype, dim: int = 0
) -> list[Tensor]:
    """Copies of ``tensors`` (all of one shape) on ``devices``: each run of consecutive tensors on
    one device becomes slices of one buffer, stacked along ``dim`` of the result (``dim=0``: each
    slice contiguous; ``dim=1`` with 2-D tensors: side by side as columns, for :func:`cat` on
    dim 1)."""
    out: list[Tensor] = []
    start = 0
    while start < len(tensors):
        end = start
        while end < len(tensors) and devices[end] == devices[start]:
            end += 1
        buffer = torch.stack([t.to(devices[start], dtype) for t in tensors[start:end]], dim=dim)
        out.extend(buffer.unbind(dim))
        start = end
    return out


def _joined(tensors: Sequence[Tensor], dim: int | None) -> Tensor | None:
    """The view that ``stack`` (``dim=None``: new leading dim) or ``cat`` along ``dim`` would
    produce, when ``tensors`` are equally shaped, equally spaced slices of one storage; else None."""
    first = tensors[0]
    if len(tensors) == 1:
        return first.unsqueeze(0) if dim is None else first
    like = (first.untyped_storage().data_ptr(), first.shape, first.stride(), first.dtype, first.device)
    if any((t.untyped_storage().data_ptr(), t.shape, t.stride(), t.dtype, t.device) != like for t in tensors):
        return None
    offset = first.storage_offset()
    step = tensors[1].storage_offset() - offset
    if step <= 0 or any(t.storage_offset() - offset != i * step for i, t in enumerate(tensors)):
        return None
    if dim is None:
        size, stride = (len(tensors), *first.shape), (step, *first.stride())
    else:
        if step != first.shape[dim] * first.stride(dim):
            return None
        size = (*first.shape[:dim], first.shape[dim] * len(tensors), *first.shape[dim + 1 :])
        stride = first.stride()
    return first.as_strided(size, stride, first.storage_offset())


def stack(tensors: Sequence[Tensor]) -> Tensor:
    """``torch.stack(tensors)``, a view when they are consecutive slices of one buffer."""
    view = _joined(tensors, None)
    return view if view is not None else torch.stack(list(tensors))


def cat(tensors: Sequence[Tensor], dim: int) -> Tensor:
    """``torch.cat(tensors, dim)``, a view when they are consecutive slices of one buffer."""
    view = _joined(tensors, dim)
    return view if view is not None else torch.cat(list(tensors), dim=dim)


def assign(tensors: Sequence[Tensor], values: Tensor) -> None:
    """Copy ``values[i]`` into ``tensors[i]`` in place: one copy when the tensors are consecutive
    slices of one buffer."""
    view = _joined(tensors, None)
    if view is not None:
        view.copy_(values)
    else:
        for t, v in zip(tensors, values.unbind(0), strict=True):
            t.copy_(v)

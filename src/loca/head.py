"""The frozen head: per-position cross-entropy and its exact error, without full logits.

For normalised final hidden states ``hn`` (N×d, only the predict positions), the logits are
``z = T(W hn + b)`` where ``T`` is the model's fixed logit transform (a scale and/or a tanh
soft-cap). The head error ``e = dLoss/dhn = W^T (dz/dz0 ⊙ (softmax(z) − onehot(y)))`` is computed in
one pass over vocabulary chunks with an online softmax (as in flash attention), so memory is
``N × chunk`` rather than ``N × V``, and the head matmul is done once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LogitTransform:
    """``z = softcap · tanh(scale · z0 / softcap)`` (or ``scale · z0`` without a soft-cap)."""

    scale: float = 1.0
    softcap: float | None = None

    def apply(self, z0: Tensor) -> tuple[Tensor, Tensor | float]:
        """Return the transformed logits and the derivative ``dz/dz0`` (a scalar without soft-cap)."""
        z = z0 * self.scale if self.scale != 1.0 else z0
        if self.softcap is None:
            return z, self.scale
        t = torch.tanh(z / self.softcap)
        return self.softcap * t, self.scale * (1.0 - t * t)


def head_loss_and_error(
    hn: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    transform: LogitTransform = LogitTransform(),
    *,
    need_error: bool = True,
    vocab_chunk: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Cross-entropy per row and (optionally) the head error ``dLoss_t/dhn_t``.

    Args:
        hn: normalised final hidden states at predict positions, N×d.
        weight: head weight V×d (any dtype; chunks are cast to the compute dtype).
        bias: head bias of length V, or None.
        targets: next-token ids, length N.
    Returns:
        ``(loss, e)``: loss (N,) in nats and e (N×d), or None when ``need_error`` is False.
    The compute dtype is float32, or float64 when ``hn`` is float64. ``vocab_chunk`` defaults to
    16384 rows, fewer for wide models, so a chunk of the weight cast to the compute dtype (for a
    bf16/fp16 head) stays near 8 MB.
    """
    dtype = torch.promote_types(hn.dtype, torch.float32)
    hn = hn.to(dtype)
    n, vocab = hn.shape[0], weight.shape[0]
    if vocab_chunk is None:
        vocab_chunk = max(2048, min(16384, 2**21 // weight.shape[1]))
    running_max = torch.full((n,), float("-inf"), dtype=dtype, device=hn.device)
    denom = torch.zeros(n, dtype=dtype, device=hn.device)
    acc = torch.zeros_like(hn) if need_error else None
    z_target = torch.zeros(n, dtype=dtype, device=hn.device)
    dz_target = torch.full((n,), float(transform.scale), dtype=dtype, device=hn.device)
    for start in range(0, vocab, vocab_chunk):
        w = weight[start : start + vocab_chunk].to(dtype)
        z0 = hn @ w.T
        if bias is not None:
            z0 = z0 + bias[start : start + vocab_chunk].to(dtype)
        z, dz = transform.apply(z0)
        # the target's logit and derivative, gathered without a host sync (no data-dependent
        # indexing): clamp the index into the chunk, keep it only where the target falls inside
        in_chunk = (targets >= start) & (targets < start + w.shape[0])
        local = (targets - start).clamp(0, w.shape[0] - 1).long()[:, None]
        z_target = torch.where(in_chunk, z.gather(1, local)[:, 0], z_target)
        if torch.is_tensor(dz):
            dz_target = torch.where(in_chunk, dz.gather(1, local)[:, 0], dz_target)
        new_max = torch.maximum(running_max, z.max(dim=1).values)
        rescale = torch.exp(running_max - new_max)
        p = torch.exp(z - new_max[:, None])
        denom = denom * rescale + p.sum(dim=1)
        if acc is not None:
            acc = acc * rescale[:, None] + ((p * dz) if torch.is_tensor(dz) else p) @ w
        running_max = new_max
    loss = running_max + torch.log(denom) - z_target
    if acc is None:
        return loss, None
    if not transform.softcap and transform.scale != 1.0:  # the constant dz/dz0 left out above
        acc = acc * transform.scale
    error = acc / denom[:, None] - dz_target[:, None] * weight[targets].to(dtype)
    return loss, error

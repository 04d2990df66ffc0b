"""The frozen head: per-position cross-entropy and its exact error, without full logits.

For normalised final hidden states ``hn`` (N×d, only the predict positions), the logits are
``z = T(W hn + b)`` where ``T`` is the model's fixed logit transform (a scale and/or a tanh
soft-cap). The head error ``e = dLoss/dhn = W^T (dz/dz0 ⊙ (softmax(z) − onehot(y)))`` is computed in
one pass over vocabulary chunks with an online softmax (as in flash attention), so memory is
``N × chunk`` rather than ``N × V``, and the head matmul is done once. A low-precision head takes
two passes (see :func:`head_loss_and_error`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

WHOLE_BYTES = 64 * 2**20  # the largest N×V low-precision logits taken in one matmul per pass


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
        weight: head weight V×d.
        bias: head bias of length V, or None.
        targets: next-token ids, length N.
        vocab_chunk: vocabulary rows per chunk of float32 work; default: as many as keep an
            N×chunk float32 tensor near 4 MB on a CPU (cache-sized) and 8 MB on a GPU, at
            least 1,024.
    Returns:
        ``(loss, e)``: loss (N,) in nats and e (N×d), or None when ``need_error`` is False.

    Softmax, loss and error arithmetic run in float32 (float64 when ``hn`` is). A float32/64 head
    takes one pass with an online softmax. A bf16/fp16 head is never copied to float32 (that copy
    would cost more memory than the forward's activations): its matmuls run in its own dtype, as
    the model's forward and autograd do, in two passes — the log-normaliser first, then
    ``softmax − onehot`` formed in float32 *before* it is rounded for the second matmul, so a
    confident prediction's small error is not lost to cancellation. While its N×V logits fit
    ``WHOLE_BYTES`` each pass is one matmul over the whole vocabulary (the float32 work still
    chunk by chunk), and the error overwrites the used-up logits: no chunk's partial error is
    rounded to the head's dtype on its own.
    """
    dtype = torch.promote_types(hn.dtype, torch.float32)
    n, vocab = hn.shape[0], weight.shape[0]
    budget = 2**21 if hn.device.type == "cuda" else 2**20  # float32 elements of one N×chunk block
    chunk = vocab_chunk or max(1024, budget // max(n, 1))
    low_precision = weight.dtype.itemsize < 4
    mm_dtype = weight.dtype if low_precision else dtype
    hn_mm = hn.to(mm_dtype)
    online = need_error and not low_precision
    # a low-precision head's two passes take one matmul each over the whole vocabulary while its
    # N×V logits fit WHOLE_BYTES (its error then rounded once, as the model's own backward);
    # only the float32 work goes chunk by chunk
    fits = n * vocab * weight.dtype.itemsize <= WHOLE_BYTES
    whole = hn_mm @ weight.T if need_error and low_precision and fits else None

    def chunks():
        for start in range(0, vocab, chunk):
            w = weight[start : start + chunk].to(mm_dtype)
            raw = whole[:, start : start + w.shape[0]] if whole is not None else hn_mm @ w.T
            z0 = raw.to(dtype)
            if bias is not None:
                z0 = z0 + bias[start : start + chunk].to(dtype)
            z, dz = transform.apply(z0)
            # where the target falls in this chunk, gathered without a host sync: clamp the
            # index into the chunk and keep the value only where the target is inside
            in_chunk = (targets >= start) & (targets < start + w.shape[0])
            local = (targets - start).clamp(0, w.shape[0] - 1).long()[:, None]
            yield w, raw, z, dz, in_chunk, local

    running_max = torch.full((n,), float("-inf"), dtype=dtype, device=hn.device)
    denom = torch.zeros(n, dtype=dtype, device=hn.device)
    z_target = torch.zeros(n, dtype=dtype, device=hn.device)
    dz_target = torch.full((n,), float(transform.scale), dtype=dtype, device=hn.device)
    acc = torch.zeros(n, hn.shape[1], dtype=dtype, device=hn.device) if need_error else None
    for w, _, z, dz, in_chunk, local in chunks():
        z_target = torch.where(in_chunk, z.gather(1, local)[:, 0], z_target)
        if torch.is_tensor(dz):
            dz_target = torch.where(in_chunk, dz.gather(1, local)[:, 0], dz_target)
        new_max = torch.maximum(running_max, z.max(dim=1).values)
        rescale = torch.exp(running_max - new_max)
        p = (z - new_max[:, None]).exp_()
        denom = denom * rescale + p.sum(dim=1)
        if online:
            acc = acc * rescale[:, None] + (p * dz if torch.is_tensor(dz) else p) @ w
        running_max = new_max
    lse = running_max + torch.log(denom)
    loss = lse - z_target
    if not need_error:
        return loss, None
    if online:
        if not torch.is_tensor(dz):  # the constant dz/dz0 was left out of the accumulation
            acc = acc * transform.scale
        return loss, acc / denom[:, None] - dz_target[:, None] * weight[targets].to(dtype)
    for w, raw, z, dz, in_chunk, local in chunks():
        g = (z - lse[:, None]).exp_()
        if torch.is_tensor(dz) or dz != 1.0:
            g = g.mul_(dz)
        g.scatter_add_(1, local, -(dz_target * in_chunk)[:, None])
        if whole is not None:
            raw.copy_(g)  # this chunk's logits are used up: their memory takes its error
        else:
            acc += (g.to(mm_dtype) @ w).to(dtype)
    return loss, (whole @ weight).to(dtype) if whole is not None else acc

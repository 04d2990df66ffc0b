"""Pure tensor math of LoCA: feedback-map ridge fits, Stage II statistics and block solves.

Nothing here touches a model. Solves run in float64 with Cholesky factorisations (never an
explicit inverse); regularisers are relative to the data scale so one value transfers across
data sizes and models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


class NonFiniteStatisticsError(FloatingPointError):
    """A Stage II statistic or solve produced NaN or Inf."""


def _check_finite(name: str, *tensors: Tensor) -> None:
    for t in tensors:
        if not torch.isfinite(t).all():
            raise NonFiniteStatisticsError(f"{name} contains NaN or Inf")


def _cholesky(matrix: Tensor, what: str) -> Tensor:
    """Cholesky factor of a matrix or a stack of them (one host sync for the whole stack)."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    if info.any():
        bad = int(info.flatten().nonzero()[0])
        where = f"block {bad} of the stack, " if info.ndim else ""
        raise NonFiniteStatisticsError(
            f"{what} is not positive definite ({where}Cholesky failed at minor "
            f"{int(info.flatten()[bad])}); increase the relative ridge or check the data"
        )
    return factor


@dataclass
class FeedbackFactors:
    """One block's rank-k feedback map ``F = us · v^T`` (d×k factors, never the d×d map)."""

    us: Tensor  # U_k Σ_k, d×k
    v: Tensor  # V_k, d×k, orthonormal columns

    def to_device(self, device: torch.device | str) -> FeedbackFactors:
        return FeedbackFactors(self.us.to(device), self.v.to(device))

    def apply(self, errors: Tensor, mask: Tensor | None = None) -> Tensor:
        """Map head errors (N×d) to predicted hidden-state gradients (N×d). ``mask`` (N×width, see
        :func:`gate_mask`) picks each position's own map when several sit side by side."""
        y = errors @ self.v
        return (y if mask is None else y * mask.to(y)) @ self.us.T


def feedback_factors(
    errors: Tensor, grads: Sequence[Tensor], beta_rel: float, rank: int
) -> list[FeedbackFactors]:
    """Ridge-fit ``F_l = argmin ||F E^T − G_l^T||² + β||F||²`` for every block, truncated to rank k.

    ``errors`` is E (N×d), ``grads`` the per-block G_l (N×d). β = β_rel · trace(E^T E)/d.
    With N ≤ d the dual form ``F = G^T (E E^T + βI)^{-1} E`` is used: one N×N Cholesky shared by all
    blocks, then a thin QR of E^T so that the SVD is of a d×N matrix. With N > d the primal
    ``F = G^T E (E^T E + βI)^{-1}`` is cheaper; its d×d SVD input is transient and never stored.
    """
    e = errors.to(torch.float64)
    n, d = e.shape
    if n == 0:
        raise ValueError("cannot fit feedback maps from zero probe positions")
    _check_finite("probe head errors", e)
    rank = min(rank, n, d)
    beta = beta_rel * float((e * e).sum()) / d
    eye = torch.eye(min(n, d), dtype=torch.float64, device=e.device)
    if n <= d:
        factor = _cholesky(e @ e.T + beta * eye, "E E^T + βI")
        q, r = torch.linalg.qr(e.T)  # E^T = Q R, Q d×N
    else:
        factor = _cholesky(e.T @ e + beta * eye, "E^T E + βI")
    out = []
    for g in grads:
        g = g.to(torch.float64)
        _check_finite("probe gradients", g)
        if n <= d:
            w = torch.cholesky_solve(g, factor).T @ r.T  # G^T K^{-1} R^T, d×N
            u, s, vh = torch.linalg.svd(w, full_matrices=False)
            v = q @ vh[:rank].T
        else:
            w = torch.cholesky_solve(e.T @ g, factor).T  # G^T E S^{-1}, d×d (transient)
            u, s, vh = torch.linalg.svd(w)
            v = vh[:rank].T
        out.append(FeedbackFactors(us=(u[:, :rank] * s[:rank]).float(), v=v.float()))
    return out


def gate_mask(roles: Tensor, gates: int, rank: int, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """N × gates·rank: row t is 1 in the ``rank`` columns of its role's map, 0 elsewhere; None for
    one map (``gates`` = 1: every position takes every column)."""
    if gates == 1:
        return None
    return torch.nn.functional.one_hot(roles.long(), gates).to(dtype).repeat_interleave(rank, dim=1)


def gated_feedback_factors(
    errors: Tensor, grads: Sequence[Tensor], roles: Tensor, gates: int, beta_rel: float, rank: int
) -> list[FeedbackFactors]:
    """One map per position role, fitted on that role's rows alone (:func:`feedback_factors`), the
    ``gates`` maps of a block side by side (d × gates·k), so that a position's map is picked by
    :func:`gate_mask`. A role with fewer than ``rank`` probe rows gets the map fitted on all rows
    (a task without that role, e.g. one-token answers, never uses it)."""
    if roles.shape[0] != errors.shape[0]:
        raise ValueError(f"{roles.shape[0]} roles for {errors.shape[0]} probe positions")
    roles = roles.to(errors.device)
    shared: list[FeedbackFactors] | None = None
    per_role = []
    for m in range(gates):
        idx = (roles == m).nonzero().flatten()
        if idx.numel() >= rank:
            per_role.append(feedback_factors(errors[idx], [g[idx] for g in grads], beta_rel, rank))
        else:
            shared = shared or feedback_factors(errors, grads, beta_rel, rank)
            per_role.append(shared)
    widths = {f.v.shape[1] for maps in per_role for f in maps}
    if len(widths) != 1:
        raise ValueError(f"the per-role maps have ranks {sorted(widths)}: too few probe positions")
    side_by_side = lambda l, f: torch.cat([getattr(m[l], f) for m in per_role], 1)  # noqa: E731
    return [FeedbackFactors(us=side_by_side(l, "us"), v=side_by_side(l, "v")) for l in range(len(grads))]


def alignment(factors: FeedbackFactors, errors: Tensor, grads: Tensor, mask: Tensor | None = None) -> float:
    """Frobenius cosine between the mapped errors ``F E^T`` and the true gradients ``G^T``."""
    pred = factors.apply(errors.to(factors.v.dtype), mask).double()
    g = grads.double()
    denom = float(pred.norm() * g.norm())
    return float((pred * g).sum()) / denom if denom > 0 else 0.0


def random_factors(d: int, rank: int, generator: torch.Generator) -> FeedbackFactors:
    """A random rank-k map of the same shape, the chance baseline for :func:`alignment`."""
    us = torch.randn(d, rank, generator=generator, dtype=torch.float32)
    v, _ = torch.linalg.qr(torch.randn(d, rank, generator=generator, dtype=torch.float32))
    return FeedbackFactors(us=us, v=v)


@dataclass
class BlockStats:
    """The persistent Stage II statistics of a block: r² + k·r numbers, independent of d and N.

    ``gram`` is G = Σ p p^T (r×r). ``cross`` is Σ_batches s · Y P with Y = V_k^T E^T (k×N), so
    that Σ ρ p^T = B G − η (U_k Σ_k) · cross (the update U_k M with M = Σ s Σ_k Y P; keeping Σ_k
    inside the stored factor ``us`` avoids dividing by small singular values).

    The same object can hold a stack of blocks (a leading dimension on every tensor): one batched
    kernel per statistic for all blocks, instead of a handful of tiny kernels per block.
    """

    gram: Tensor
    cross: Tensor
    positions: int = 0

    @classmethod
    def zeros(
        cls, rank: int, k: int, device: torch.device | str = "cpu", blocks: int | None = None
    ) -> BlockStats:
        lead = () if blocks is None else (blocks,)
        z = dict(dtype=torch.float64, device=device)
        return cls(gram=torch.zeros(*lead, rank, rank, **z), cross=torch.zeros(*lead, k, rank, **z))

    def __getitem__(self, i: int) -> BlockStats:
        """One block of a stack."""
        return BlockStats(self.gram[i], self.cross[i], self.positions)

    def add_inputs(self, p: Tensor) -> None:
        """Accumulate the Gram matrix of the adapter codes ``p = A h_{l-1}`` (N×r, or L×N×r)."""
        p = p.double()
        self.gram += p.mT @ p
        self.positions += p.shape[-2]

    def add_targets(
        self, p: Tensor, h_sumsq: Tensor, y: Tensor, sigma: Tensor, normalize: bool = True
    ) -> Tensor:
        """Accumulate one batch's target statistic and return its step scale ``s`` (a tensor).

        ``y = E V_k`` (N×k), ``sigma`` the singular values (k), ``h_sumsq`` = Σ ||h_{l-1}||²
        (each with a leading block dimension for a stack). The scale-normalised step is
        ``s = RMS(H_{l-1}) / RMS(Q)`` with ``Q = F E^T``; both RMS share the N·d denominator, and
        ``||Q||_F = ||Σ_k Y||_F`` since U_k is orthonormal, so ``s = ||H||_F / ||Σ_k Y||_F``.
        With ``normalize=False`` (absolute η, the paper's ablation) ``s = 1``.
        """
        y = y.double()
        if not normalize:
            s = torch.ones(y.shape[:-2], dtype=torch.float64, device=y.device)
            self.cross += y.mT @ p.double()
            return s
        q_norm = (y * sigma.to(y).unsqueeze(-2)).pow(2).sum((-2, -1)).sqrt()
        h_norm = torch.as_tensor(h_sumsq, dtype=torch.float64, device=y.device).sqrt()
        # kept as a tensor (no host sync); a zero error (q_norm = 0) contributes nothing
        s = torch.where(q_norm > 0, h_norm / q_norm, torch.zeros_like(q_norm))
        self.cross += s[..., None, None] * (y.mT @ p.double())
        return s


def relative_ridge(gram: Tensor, lam_rel: float) -> Tensor:
    """λ = λ_rel · trace(G)/r, one per matrix of a stack (a tensor: no host sync)."""
    return lam_rel * gram.diagonal(dim1=-2, dim2=-1).sum(-1) / gram.shape[-1]


def solve_block(
    b: Tensor, stats: BlockStats, us: Tensor, eta: float, lam_rel: float, center: str = "zero"
) -> Tensor:
    """One closed-form adapter update: the ridge fit of ``B' p`` to the targets ``ρ = B p − η s F e``.

    ``center="zero"`` (the paper) penalises ``λ||B'||²``: ``B ← (B G − η U_k Σ_k · cross)(G + λI)⁻¹``,
    which also shrinks B towards 0 every iteration (a fixed point where λB balances the step).
    ``center="previous"`` penalises ``λ||B' − B||²``: ``B ← B − η U_k Σ_k · cross (G + λI)⁻¹``, a
    damped step with no shrinkage.

    Every argument may carry a leading block dimension (B L×d×r, a stacked :class:`BlockStats`,
    U_k Σ_k L×d×k): all blocks are then solved by one batched factorisation, with a few host
    syncs for the whole stack instead of a few per block."""
    g = stats.gram
    _check_finite("adapter statistics", g, stats.cross)
    trace = g.diagonal(dim1=-2, dim2=-1).sum(-1)
    if (trace <= 0).any():
        raise ValueError("no adapter inputs were accumulated (empty Gram matrix)")
    if center not in ("zero", "previous"):
        raise ValueError(f"center must be 'zero' or 'previous', got {center!r}")
    c = b.double() @ g - eta * (us.double() @ stats.cross)
    lam = relative_ridge(g, lam_rel)[..., None, None]
    if center == "previous":
        c = c + lam * b.double()
    eye = torch.eye(g.shape[-1], dtype=g.dtype, device=g.device)
    factor = _cholesky(g + lam * eye, "G + λI")
    new_b = torch.cholesky_solve(c.mT, factor).mT
    _check_finite("adapter solve", new_b)
    return new_b.to(b.dtype)


def nystrom_top_eigenvectors(sketch: Tensor, omega: Tensor, rank: int) -> Tensor:
    """The top-``rank`` eigenvectors (d×rank, orthonormal columns) of a PSD matrix ``M`` known only
    through the streamed sketch ``Y = M Ω`` and its test matrix ``Ω`` (d×m, m ≥ rank).

    The stabilised Nyström approximation ``M ≈ Y (ΩᵀY)⁻¹ Yᵀ`` (Tropp et al., 2017, Alg. 3): a shift
    ``ν`` keeps ``ΩᵀY`` positive definite, so one pass over the data suffices. Each column's
    largest entry is positive."""
    y = sketch.to(torch.float64)
    omega = omega.to(y)
    if rank > y.shape[1]:
        raise ValueError(f"rank {rank} exceeds the sketch width {y.shape[1]}")
    _check_finite("principal-direction sketch", y)
    nu = torch.finfo(torch.float64).eps * max(float(torch.linalg.matrix_norm(y)), 1e-300) * y.shape[0]
    y_nu = y + nu * omega
    core = omega.T @ y_nu
    factor = _cholesky((core + core.T) / 2, "the Nyström core ΩᵀMΩ")
    e = torch.linalg.solve_triangular(factor, y_nu.T, upper=False).T  # Y_ν L⁻ᵀ
    u, _, _ = torch.linalg.svd(e, full_matrices=False)
    u = u[:, :rank]
    # an eigenvector's sign is arbitrary: fix it (largest entry positive), so that sums taken in
    # another order (another BLAS, data-parallel ranks) give the same A, not its mirror image
    pivot = u.gather(0, u.abs().argmax(0, keepdim=True))
    return u * torch.where(pivot < 0, -1.0, 1.0).to(u)

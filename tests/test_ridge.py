"""The pure math of ridge.py against direct float64 references (lstsq, explicit SVD)."""

import pytest
import torch

from loca.core.ridge import (
    BlockStats,
    NonFiniteStatisticsError,
    alignment,
    feedback_factors,
    random_factors,
    relative_ridge,
    solve_block,
)

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def primal_map(e, g, beta_rel):
    """The dense ridge map from its normal equations, solved by lstsq on an augmented system."""
    d = e.shape[1]
    beta = beta_rel * float((e * e).sum()) / d
    # min ||E Fᵀ − G||² + β||F||²  ==  lstsq([E; √β I] Fᵀ = [G; 0])
    aug_x = torch.cat([e, beta**0.5 * torch.eye(d)])
    aug_y = torch.cat([g, torch.zeros(d, g.shape[1])])
    return torch.linalg.lstsq(aug_x, aug_y).solution.T


def truncate(f, k):
    u, s, vh = torch.linalg.svd(f)
    return u[:, :k] @ torch.diag(s[:k]) @ vh[:k]


@pytest.mark.parametrize("n,d", [(12, 20), (40, 16)])  # dual (N ≤ d) and primal (N > d) paths
@pytest.mark.parametrize("k", [3, 50])
def test_feedback_factors_match_primal_ridge_and_svd(n, d, k):
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(n, d, generator=gen)
    grads = [torch.randn(n, d, generator=gen) @ torch.randn(d, d, generator=gen) for _ in range(3)]
    factors = feedback_factors(e, grads, beta_rel=1e-2, rank=k)
    for f, g in zip(factors, grads, strict=True):
        dense = primal_map(e, g, 1e-2)
        kk = min(k, n, d)
        want = truncate(dense, kk)
        got = f.us.double() @ f.v.double().T
        assert f.us.shape == (d, kk) and f.v.shape == (d, kk)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        # V has orthonormal columns, so ||F e|| is computed from the k-vector alone
        torch.testing.assert_close(f.v.double().T @ f.v.double(), torch.eye(kk), atol=1e-5, rtol=0)


def test_full_rank_map_recovers_a_linear_relation():
    gen = torch.Generator().manual_seed(1)
    e = torch.randn(200, 10, generator=gen)
    true = torch.randn(10, 10, generator=gen)
    (f,) = feedback_factors(e, [e @ true.T], beta_rel=1e-9, rank=10)
    torch.testing.assert_close(f.us.double() @ f.v.double().T, true, atol=1e-4, rtol=1e-4)
    assert alignment(f, e, e @ true.T) == pytest.approx(1.0, abs=1e-6)


def test_random_map_alignment_is_near_zero():
    gen = torch.Generator().manual_seed(2)
    e = torch.randn(500, 64, generator=gen)
    g = e @ torch.randn(64, 64, generator=gen)
    r = random_factors(64, 8, gen)
    assert abs(alignment(r, e.float(), g.float())) < 0.2


def test_stats_give_the_naive_c_with_explicit_targets():
    """G and cross reproduce C = Σ ρ pᵀ with ρ = B p − η s F e, s = RMS(H)/RMS(F E)."""
    gen = torch.Generator().manual_seed(3)
    d, r, k = 24, 6, 4
    us = torch.randn(d, k, generator=gen)
    v, _ = torch.linalg.qr(torch.randn(d, k, generator=gen))
    u, _ = torch.linalg.qr(torch.randn(d, k, generator=gen))
    sigma = torch.rand(k, generator=gen) + 0.5
    us = u * sigma  # U_k Σ_k with orthonormal U_k
    a = torch.randn(r, d, generator=gen)
    b = torch.randn(d, r, generator=gen)
    eta = 0.05
    stats = BlockStats.zeros(r, k)
    c_naive = torch.zeros(d, r)
    for n in (7, 11, 5):  # three batches
        h = torch.randn(n, d, generator=gen) * 3
        e = torch.randn(n, d, generator=gen)
        p = h @ a.T
        stats.add_inputs(p)
        s = stats.add_targets(p, h.pow(2).sum(), e @ v, sigma)
        q = e @ v @ us.T  # F e for each row
        rms = lambda x: x.norm() / x.numel() ** 0.5  # noqa: E731
        assert float(s) == pytest.approx(float(rms(h) / rms(q)), rel=1e-10)
        rho = p @ b.T - eta * s * q
        c_naive += rho.T @ p
    c = b @ stats.gram - eta * us @ stats.cross
    torch.testing.assert_close(c, c_naive, atol=1e-9, rtol=1e-9)
    assert stats.positions == 23


@pytest.mark.parametrize("center", ["zero", "previous"])
def test_solve_block_is_the_ridge_solution(center):
    """B_new = argmin Σ||B' p − ρ||² + λ||B' − c||² (c = 0, or the previous B), checked with lstsq
    on the explicit targets."""
    gen = torch.Generator().manual_seed(4)
    d, r, k, n = 16, 5, 3, 40
    p = torch.randn(n, r, generator=gen)
    y = torch.randn(n, k, generator=gen)
    sigma = torch.ones(k)
    u, _ = torch.linalg.qr(torch.randn(d, k, generator=gen))
    b = torch.randn(d, r, generator=gen)
    stats = BlockStats.zeros(r, k)
    stats.add_inputs(p)
    s = stats.add_targets(p, torch.tensor(7.0), y, sigma)
    eta, lam_rel = 0.3, 1e-2
    got = solve_block(b, stats, u, eta, lam_rel, center=center)
    rho = p @ b.T - eta * s * (y @ u.T)
    lam = lam_rel * float(torch.trace(p.T @ p)) / r
    x = torch.cat([p, lam**0.5 * torch.eye(r)])
    anchor = b.T if center == "previous" else torch.zeros(r, d)
    t = torch.cat([rho, lam**0.5 * anchor])
    want = torch.linalg.lstsq(x, t).solution.T
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
    assert relative_ridge(stats.gram, lam_rel) == pytest.approx(lam)


def test_non_finite_statistics_raise():
    stats = BlockStats.zeros(2, 2)
    stats.add_inputs(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(NonFiniteStatisticsError):
        solve_block(torch.zeros(3, 2), stats, torch.zeros(3, 2), 0.1, 1e-3)
    with pytest.raises(NonFiniteStatisticsError):
        feedback_factors(torch.full((3, 4), float("inf")), [torch.zeros(3, 4)], 1e-3, 2)


def test_empty_gram_is_an_error():
    with pytest.raises(ValueError, match="no adapter inputs"):
        solve_block(torch.zeros(3, 2), BlockStats.zeros(2, 2), torch.zeros(3, 2), 0.1, 1e-3)


def test_a_stack_of_blocks_equals_the_blocks_one_by_one():
    gen = torch.Generator().manual_seed(5)
    n_blocks, n, r, k = 3, 9, 4, 2
    p = torch.randn(n_blocks, n, r, generator=gen)
    y = torch.randn(n_blocks, n, k, generator=gen)
    hs = torch.rand(n_blocks, generator=gen) * 10
    sigma = torch.rand(n_blocks, k, generator=gen) + 0.1
    stack = BlockStats.zeros(r, k, blocks=n_blocks)
    stack.add_inputs(p)
    s_all = stack.add_targets(p, hs, y, sigma)
    for i in range(n_blocks):
        one = BlockStats.zeros(r, k)
        one.add_inputs(p[i])
        s = one.add_targets(p[i], hs[i], y[i], sigma[i])
        torch.testing.assert_close(stack[i].gram, one.gram)
        torch.testing.assert_close(stack[i].cross, one.cross)
        torch.testing.assert_close(s_all[i], s)


def test_absolute_step_uses_eta_unscaled():
    """With normalize=False the target is ρ = B p − η F e (s = 1), the paper's absolute-η ablation."""
    gen = torch.Generator().manual_seed(4)
    d, r, k, n = 20, 5, 3, 9
    u, _ = torch.linalg.qr(torch.randn(d, k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(d, k, generator=gen))
    sigma = torch.rand(k, generator=gen) + 0.5
    us = u * sigma
    a, b = torch.randn(r, d, generator=gen), torch.randn(d, r, generator=gen)
    h, e = torch.randn(n, d, generator=gen) * 5, torch.randn(n, d, generator=gen)
    p = h @ a.T
    stats = BlockStats.zeros(r, k)
    stats.add_inputs(p)
    s = stats.add_targets(p, h.pow(2).sum(), e @ v, sigma, normalize=False)
    assert float(s) == 1.0
    rho = p @ b.T - 0.1 * (e @ v @ us.T)
    c = b @ stats.gram - 0.1 * us @ stats.cross
    torch.testing.assert_close(c, rho.T @ p, atol=1e-9, rtol=1e-9)


def test_solve_block_centers():
    """With no step (η = 0) the paper's ridge shrinks B towards zero; the proximal one keeps it."""
    gen = torch.Generator().manual_seed(5)
    p, b = torch.randn(30, 4, generator=gen), torch.randn(6, 4, generator=gen)
    stats = BlockStats.zeros(4, 2)
    stats.add_inputs(p)
    torch.testing.assert_close(solve_block(b, stats, torch.zeros(6, 2), 0.0, 1e-1, "previous"), b)
    assert solve_block(b, stats, torch.zeros(6, 2), 0.0, 1e-1).norm() < b.norm()
    with pytest.raises(ValueError, match="center"):
        solve_block(b, stats, torch.zeros(6, 2), 0.0, 1e-1, "bogus")

"""Credit mechanisms: maps gated by the predict position's role."""

import pytest
import torch
from test_fit import adapter_gradient, short_prompt_items
from tiny import sequences, tiny_parts

from loca.config import LocaConfig
from loca.core.ridge import alignment, feedback_factors, gate_mask, gated_feedback_factors, solve_block
from loca.data.batching import Encoded, make_batches, position_roles
from loca.method.adapters import ResidualAdapters
from loca.method.calibrate import calibrate
from loca.method.fit import fit
from loca.method.maps import FeedbackMaps
from loca.method.probe import probe_gradients, probe_roles
from loca.method.stage2 import collect_statistics


@pytest.mark.unit
def test_position_roles():
    items = [
        Encoded((5, 6), (7, 8, 9, 2), has_eos=True),  # first, inside, inside, eos
        Encoded((5,), (7,), has_eos=False),  # first only
        Encoded((5, 6, 7), (8, 2), has_eos=True),  # first, eos
    ]
    batch = make_batches(items, pad_id=0, batch_size=8)[0]
    by_row = {}
    for b, r in zip(batch.pos_b.tolist(), batch.roles.tolist(), strict=True):
        by_row.setdefault(len(batch.items[b].completion), []).append(r)
    assert by_row == {4: [0, 1, 1, 2], 1: [0], 2: [0, 2]}
    # the probe's rows come in make_batches' order whatever the micro-batches
    assert torch.equal(probe_roles(items, 0), torch.cat([b.roles for b in make_batches(items, 0, 1)]))
    assert torch.equal(position_roles(batch.pos_b, batch.is_eos), batch.roles)


def _role_credit(n=90, d=16, k=4, seed=0):
    """Errors, roles and gradients from a known rank-k map per role and block."""
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(n, d, generator=gen, dtype=torch.float64)
    roles = torch.arange(n) % 3
    maps = [
        [
            torch.randn(d, k, generator=gen, dtype=torch.float64)
            @ torch.randn(k, d, generator=gen, dtype=torch.float64)
            for _ in range(3)
        ]
        for _ in range(2)
    ]
    grads = [torch.stack([f[int(r)] @ e[t] for t, r in enumerate(roles)]) for f in maps]
    return e, roles, grads


@pytest.mark.unit
def test_gated_maps_recover_a_role_dependent_linear_credit_exactly():
    e, roles, grads = _role_credit()
    factors = gated_feedback_factors(e, grads, roles, 3, beta_rel=1e-12, rank=4)
    mask = gate_mask(roles, 3, 4, torch.float64)
    for f, g in zip(factors, grads, strict=True):
        assert f.us.shape == (16, 12)
        pred = f.apply(e.float(), mask).double()
        assert torch.allclose(pred, g, rtol=1e-3, atol=1e-3 * float(g.abs().max()))
        assert alignment(f, e, g, mask) > 0.99999
    # one map for all roles cannot: the credit is not linear in e alone
    single = feedback_factors(e, grads, beta_rel=1e-12, rank=4)
    assert max(alignment(f, e, g) for f, g in zip(single, grads, strict=True)) < 0.8


@pytest.mark.unit
def test_a_role_with_too_few_rows_gets_the_shared_map():
    e, roles, grads = _role_credit()
    roles = roles.clone()
    roles[roles == 2] = 1  # no EOS rows
    factors = gated_feedback_factors(e, grads, roles, 3, beta_rel=1.0, rank=4)
    shared = feedback_factors(e, grads, beta_rel=1.0, rank=4)
    for f, s in zip(factors, shared, strict=True):
        assert torch.equal(f.us[:, 8:], s.us) and torch.equal(f.v[:, 8:], s.v)
    with pytest.raises(ValueError, match="roles for"):
        gated_feedback_factors(e, grads, roles[:-1], 3, 1.0, 4)


@pytest.mark.integration
def test_gated_stage2_step_is_the_adapter_gradient_with_exact_per_role_credit():
    model, parts = tiny_parts(hidden=32)
    items = short_prompt_items(12)  # roles: 12 first + 12 inside positions, each ≤ d: the fits interpolate
    batches = make_batches(items, pad_id=0, batch_size=100)
    maps = calibrate(
        parts, items, feedback_rank=12, beta_rel=1e-12, probe_micro_batch=100, feedback_gate="role"
    )
    assert maps.gate == "role" and maps.gates == 3 and maps.rank == 12 and maps.width == 36
    assert min(maps.meta["alignment"]["probe"]) > 0.9999  # F_role(t) e_t = g_t at every probe row
    adapters = ResidualAdapters(parts, rank=4, seed=1).attach()
    stats, _ = collect_statistics(parts, adapters, maps, batches, range(parts.num_blocks))
    for layer in range(parts.num_blocks):
        assert stats[layer].cross.shape == (36, 4)
        new_b = solve_block(adapters.B[layer], stats[layer], maps.factors[layer].us, 0.01, 1e4)
        grad = adapter_gradient(model, parts, batches[0], layer, 4, seed=1)
        cos = float((new_b.double() * -grad).sum() / (new_b.double().norm() * grad.norm()))
        assert cos > 0.999, (layer, cos)


@pytest.mark.integration
def test_gated_statistics_equal_their_closed_form():
    """cross = Σ_t s · (mask_t ∘ V^T e_t) p_tᵀ, with s = ||H||_F / ||Σ_k y||_F over the batch."""
    model, parts = tiny_parts(hidden=32, layers=2)
    items = sequences(10, seed=3)
    batch = make_batches(items, pad_id=0, batch_size=100)[0]
    maps = calibrate(parts, items, feedback_rank=3, beta_rel=1.0, probe_micro_batch=4, feedback_gate="role")
    adapters = ResidualAdapters(parts, rank=4, seed=2).attach()
    stats, _ = collect_statistics(parts, adapters, maps, [batch], range(parts.num_blocks))
    e, _ = probe_gradients(parts, items, 100, 0)  # same rows, same order
    h_in = {}
    hooks = [
        blk.register_forward_hook(
            lambda m, a, kw, o, l=l: h_in.__setitem__(l, a[0] if a else kw["hidden_states"]), with_kwargs=True
        )
        for l, blk in enumerate(parts.blocks)
    ]
    with torch.no_grad():
        parts.final_hidden(batch.input_ids, batch.attention_mask, batch.pos_b, batch.pos_t)
    for h in hooks:
        h.remove()
    mask = gate_mask(batch.roles, 3, 3, torch.float64)
    for l in range(parts.num_blocks):
        h = h_in[l][batch.pos_b, batch.pos_t].double()
        p = h @ adapters.A[l].double().T
        y = (e.double() @ maps.factors[l].v.double()) * mask
        s = h.norm() / (y * maps.sigma(l).double()).norm()
        assert torch.allclose(stats[l].cross, s * y.T @ p, rtol=1e-6, atol=1e-9)


@pytest.mark.integration
def test_gated_maps_save_load_and_fit(tmp_path):
    model, parts = tiny_parts(hidden=32, layers=2)
    train, held = sequences(24, seed=0), sequences(12, seed=1)
    cfg = LocaConfig(feedback_gate="role", feedback_rank=4, rank=4, max_iters=4, cuda_graphs=False)
    maps = calibrate(parts, train, held, feedback_rank=4, feedback_gate="role", probe_micro_batch=8)
    assert len(maps.meta["alignment"]["heldout"]) == parts.num_blocks
    maps.save_pretrained(tmp_path / "maps")
    loaded = FeedbackMaps.from_pretrained(tmp_path / "maps", parts)
    assert loaded.gate == "role" and loaded.rank == 4
    tb, hb = make_batches(train, 0, 8), make_batches(held, 0, 8)
    a = fit(parts, maps, tb, hb, cfg, progress=False)
    b_a = [x.clone() for x in a.adapters.get_b()]
    a.adapters.detach()
    b = fit(parts, loaded, tb, hb, cfg, progress=False)
    assert a.heldout_ce < a.frozen_heldout_ce
    assert all(torch.equal(x, y) for x, y in zip(b_a, b.adapters.get_b(), strict=True))
    b.adapters.detach()
    # a config that claims another gate than the factors' shape allows is refused
    import json

    cfg_path = tmp_path / "maps" / "feedback_config.json"
    meta = json.loads(cfg_path.read_text())
    meta["feedback_gate"] = "bogus"
    cfg_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="feedback_gate"):
        FeedbackMaps.from_pretrained(tmp_path / "maps", parts)


@pytest.mark.unit
def test_feedback_gate_is_validated():
    with pytest.raises(ValueError, match="feedback_gate"):
        LocaConfig(feedback_gate="cluster")


# -- synthetic probe errors ---------------------------------------------------------------------


def _reference_gradients(parts, items, errors):
    """dL/dh_l at the predict positions when ``errors`` (N×d, make_batches' row order) is the
    incoming gradient at n(h_L): one forward and autograd.grad, all items in one batch."""
    batch = make_batches(items, pad_id=0, batch_size=len(items))[0]
    outs = []
    hooks = [
        blk.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
        for blk in parts.blocks
    ]
    try:
        with torch.enable_grad():
            embeds = parts.model.get_input_embeddings()(batch.input_ids).detach().requires_grad_(True)
            hn = parts.final_hidden(
                batch.input_ids, batch.attention_mask, batch.pos_b, batch.pos_t, inputs_embeds=embeds
            )
            grads = torch.autograd.grad(hn, outs, errors.to(hn.dtype))
    finally:
        for h in hooks:
            h.remove()
    return [g[batch.pos_b, batch.pos_t] for g in grads]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.unit
def test_synthetic_probe_rows_are_exact_gradients_of_their_errors(recompute):
    model, parts = tiny_parts(hidden=32, layers=2)
    items = sequences(9, seed=4, answers=5)
    e0, g0 = probe_gradients(parts, items, 4, 0)
    e, g = probe_gradients(parts, items, 4, 0, recompute=recompute, synthetic=2, seed=7)
    n = e0.shape[0]
    assert e.shape[0] == 3 * n
    assert torch.allclose(e[:n], e0) and all(torch.allclose(a[:n], b) for a, b in zip(g, g0, strict=True))
    targets = make_batches(items, 0, len(items))[0].targets
    vocab = {t for it in items for t in it.completion}
    w = parts.head.weight.float()
    for k in (1, 2):
        ek = e[k * n : (k + 1) * n]
        # W_u[j] − W_u[y] with j an answer token of the probe
        j = [next(v for v in vocab if torch.allclose(ek[t] + w[targets[t]], w[v])) for t in range(n)]
        assert set(j) <= vocab and len(set(j)) > 1
        ref = _reference_gradients(parts, items, ek.double())
        for l in range(parts.num_blocks):
            assert torch.allclose(g[l][k * n : (k + 1) * n].double(), ref[l].double(), rtol=1e-5, atol=1e-8)
    # seeded: the same rows again, other rows for another seed
    e2, _ = probe_gradients(parts, items, 3, 0, synthetic=2, seed=7)
    assert torch.equal(e2, e)
    e3, _ = probe_gradients(parts, items, 4, 0, synthetic=2, seed=8)
    assert not torch.equal(e3[n:], e[n:])


@pytest.mark.integration
def test_synthetic_rows_join_the_fit_as_one_pooled_set():
    from loca.method.calibrate import _pooled

    model, parts = tiny_parts(hidden=32, layers=2)
    items = sequences(12, seed=5, answers=6)
    maps = calibrate(
        parts, items, feedback_rank=4, beta_rel=1.0, probe_micro_batch=4, probe_synthetic=3, seed=2
    )
    e, g = probe_gradients(parts, items, 4, 0, synthetic=3, seed=2)
    n = e.shape[0] // 4
    roles = probe_roles(items, 0)
    pooled = _pooled([(e[:n], [x[:n] for x in g], roles), (e[n:], [x[n:] for x in g], roles.repeat(3))])
    ref = feedback_factors(pooled[0], pooled[1], 1.0, 4)
    for f, r in zip(maps.factors, ref, strict=True):
        assert torch.allclose(f.us, r.us, atol=1e-6) and torch.allclose(f.v, r.v, atol=1e-6)
    assert maps.meta["probe_synthetic"] == 3 and maps.meta["probe_positions"] == n
    plain = calibrate(parts, items, feedback_rank=4, beta_rel=1.0, probe_micro_batch=4)
    assert not torch.allclose(plain.factors[0].us, maps.factors[0].us)
    with pytest.raises(ValueError, match="probe_synthetic"):
        LocaConfig(probe_synthetic=-1)

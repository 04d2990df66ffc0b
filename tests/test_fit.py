"""Stage II: exact-gradient direction, selection, snapshots, safety and determinism."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from tiny import SEQUENCE_VOCAB, sequences, tiny_parts

from loca.config import LocaConfig
from loca.core.ridge import FeedbackFactors, solve_block
from loca.data.batching import Encoded, make_batches
from loca.method.adapters import ResidualAdapters, adapter_a
from loca.method.calibrate import calibrate
from loca.method.fit import fit
from loca.method.maps import FeedbackMaps
from loca.method.stage2 import block_groups, collect_statistics, solve_blocks

pytestmark = pytest.mark.integration

stage2_mod = importlib.import_module("loca.method.stage2")


def short_prompt_items(n, seed=0):
    """One-token prompts: every position with a non-zero gradient is a predict position, so the
    predict-position statistics see the whole adapter gradient."""
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(3, SEQUENCE_VOCAB, (n, 3), generator=gen).tolist()
    return [Encoded((a,), (b, c)) for a, b, c in toks]


def adapter_gradient(model, parts, batch, layer, rank, seed):
    a = adapter_a(seed, layer, rank, parts.hidden_size).double()
    b = torch.zeros(parts.hidden_size, rank, dtype=torch.float64, requires_grad=True)

    def hook(module, args, output):
        return output + (args[0] @ a.T) @ b.T

    h = parts.blocks[layer].register_forward_hook(hook)
    with torch.enable_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        loss = F.cross_entropy(logits[batch.pos_b, batch.pos_t], batch.targets, reduction="sum")
        (grad,) = torch.autograd.grad(loss, b)
    h.remove()
    return grad


@pytest.mark.parametrize("lam_rel,min_cos", [(1e4, 0.999), (1e-3, 0.0)])
def test_exact_gradient_feedback_moves_b_against_the_adapter_gradient(lam_rel, min_cos):
    model, parts = tiny_parts(hidden=32)
    items = short_prompt_items(12)  # 24 positions ≤ d = 32: the dual fit interpolates, F e_t = g_t
    batches = make_batches(items, pad_id=0, batch_size=100)
    maps = calibrate(parts, items, feedback_rank=24, beta_rel=1e-12, probe_micro_batch=100)
    adapters = ResidualAdapters(parts, rank=4, seed=1).attach()
    stats, _ = collect_statistics(parts, adapters, maps, batches, range(parts.num_blocks))
    for layer in range(parts.num_blocks):
        new_b = solve_block(adapters.B[layer], stats[layer], maps.factors[layer].us, 0.01, lam_rel)
        grad = adapter_gradient(model, parts, batches[0], layer, 4, seed=1)
        cos = float((new_b.double() * -grad).sum() / (new_b.double().norm() * grad.norm()))
        assert cos > min_cos, (layer, cos)


@pytest.mark.parametrize("budget_mb", [64.0, 1e-6])  # all blocks in one solve / one block at a time
def test_solve_blocks_in_place_matches_each_blocks_solve(budget_mb):
    model, parts = tiny_parts(hidden=32, layers=3)
    items = short_prompt_items(12)
    batches = make_batches(items, pad_id=0, batch_size=6)
    maps = calibrate(parts, items, feedback_rank=8, beta_rel=1e-3, probe_micro_batch=12)
    adapters = ResidualAdapters(parts, rank=4, seed=1).attach()
    gen = torch.Generator().manual_seed(2)
    adapters.set_b([1e-2 * torch.randn(b.shape, generator=gen) for b in adapters.B])
    stats, _ = collect_statistics(parts, adapters, maps, batches, range(parts.num_blocks))
    blocks = range(parts.num_blocks)
    want = [solve_block(adapters.B[l], stats[l], maps.factors[l].us, 0.01, 1e-3) for l in blocks]
    buffers = [b.data_ptr() for b in adapters.B]
    solve_blocks(adapters, maps, stats, blocks, 0.01, 1e-3, "zero", budget_mb=budget_mb)
    assert [b.data_ptr() for b in adapters.B] == buffers  # written in place, no second copy of B
    for got, expected in zip(adapters.B, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)


def tiny_setup(n_train=48, n_heldout=24, seed=0):
    model, parts = tiny_parts(hidden=32, layers=3)
    train_items, heldout_items = sequences(n_train, seed=seed), sequences(n_heldout, seed=seed + 100)
    maps = calibrate(parts, train_items, feedback_rank=8, beta_rel=1e-3, probe_micro_batch=16)
    train = make_batches(train_items, pad_id=0, batch_size=16)
    heldout = make_batches(heldout_items, pad_id=0, batch_size=16)
    return model, parts, maps, train, heldout


def test_fit_improves_heldout_ce_and_records_history():
    _, parts, maps, train, heldout = tiny_setup()
    res = fit(
        parts,
        maps,
        train,
        heldout,
        LocaConfig.preset("paper", rank=8, etas=[0.01, 0.03], max_iters=4),
        progress=False,
    )
    assert res.improved and res.best_iteration >= 1
    assert res.heldout_ce < res.frozen_heldout_ce
    assert res.history[0]["iteration"] == 0 and res.history[0]["heldout_ce"] == res.frozen_heldout_ce
    rows = [r for r in res.history if r["iteration"] >= 1]
    assert {r["eta"] for r in rows} == {0.01, 0.03}
    assert all({"heldout_ce", "train_ce", "b_norm", "time_s"} <= r.keys() for r in rows)
    best = min(res.history, key=lambda r: r["heldout_ce"])
    assert best["heldout_ce"] == res.heldout_ce and best["eta"] == res.eta
    # the adapters hold the selected snapshot
    from loca.eval.evaluation import completion_ce

    assert completion_ce(parts, heldout).mean == pytest.approx(res.heldout_ce, rel=1e-9)
    # iteration 1 of every candidate used the same shared statistics: identical training CE
    first = [r["train_ce"] for r in rows if r["iteration"] == 1]
    assert len(set(first)) == 1


def test_fit_is_deterministic_on_cpu():
    _, parts, maps, train, heldout = tiny_setup()
    kw = dict(cfg=LocaConfig(rank=8, etas=[0.01], max_iters=2, seed=3), progress=False)
    first = fit(parts, maps, train, heldout, **kw).adapters
    b1 = first.get_b()
    with pytest.raises(RuntimeError, match="another set"):
        fit(parts, maps, train, heldout, **kw)
    first.detach()
    b2 = fit(parts, maps, train, heldout, **kw).adapters.get_b()
    assert any(b.abs().sum() > 0 for b in b1)
    assert all(torch.equal(x, y) for x, y in zip(b1, b2, strict=True))


def test_gauss_seidel_groups():
    assert block_groups(5, 1) == [[0, 1, 2, 3, 4]]
    assert block_groups(5, 2) == [[0, 1], [2, 3, 4]]
    assert block_groups(3, 9) == [[0], [1], [2]]
    _, parts, maps, train, heldout = tiny_setup()
    res = fit(
        parts, maps, train, heldout, LocaConfig(rank=8, etas=[0.01], max_iters=2, groups=3), progress=False
    )
    assert res.improved


def test_frozen_model_is_returned_when_nothing_beats_it():
    _, parts, maps, train, heldout = tiny_setup()
    # flipped and huge maps: every step goes uphill
    bad = FeedbackMaps([FeedbackFactors(-1e3 * f.us, f.v) for f in maps.factors], maps.fingerprint)
    cfg = LocaConfig(rank=8, etas=[0.03], max_iters=3, patience=1)
    res = fit(parts, bad, train, heldout, cfg, progress=False)
    assert not res.improved and res.best_iteration == 0 and res.eta is None
    assert res.adapters.norm() == 0.0
    assert res.heldout_ce == res.frozen_heldout_ce


@pytest.mark.parametrize("control", ["fixed", "adaptive"])
def test_non_finite_statistics_stop_safely_and_keep_the_best(monkeypatch, control):
    _, parts, maps, train, heldout = tiny_setup()
    calls = {"n": 0}
    real = stage2_mod.head_loss_and_error

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss, e = real(*args, **kwargs)
        if calls["n"] > len(train):  # every pass after the first
            e = e * float("nan")
        return loss, e

    monkeypatch.setattr(stage2_mod, "head_loss_and_error", poisoned)
    cfg = LocaConfig(rank=8, etas=[0.01], max_iters=5, step_control=control)
    res = fit(parts, maps, train, heldout, cfg, progress=False)
    assert res.best_iteration == 1 and res.improved
    if control == "fixed":
        assert "non-finite" in next(iter(res.stop_reasons.values()))
    else:  # a non-finite step is a rejected one; B stays at the last good step until patience
        bad = [r for r in res.history if r["iteration"] > 1]
        assert bad and all(r["heldout_ce"] is None and "NaN" in r["error"] for r in bad)
        assert "patience" in next(iter(res.stop_reasons.values()))
    assert all(torch.isfinite(b).all() for b in res.adapters.B)


def test_interrupt_restores_the_best_snapshot(tmp_path):
    _, parts, maps, train, heldout = tiny_setup()
    adapters = ResidualAdapters(parts, rank=8)
    saved = {}

    def save(ad, row):
        saved["b"] = ad.get_b()
        ad.save_pretrained(tmp_path / "best")

    def interrupt(row):
        if row["iteration"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(
            parts,
            maps,
            train,
            heldout,
            LocaConfig(rank=8, etas=[0.01], max_iters=5),
            adapters=adapters,
            on_improve=save,
            on_iteration=interrupt,
            progress=False,
        )
    assert all(torch.equal(a, b) for a, b in zip(adapters.get_b(), saved["b"], strict=True))
    on_disk = ResidualAdapters.from_pretrained(parts, tmp_path / "best")
    assert all(torch.equal(a, b) for a, b in zip(on_disk.get_b(), saved["b"], strict=True))


def test_empty_sets_are_errors():
    _, parts, maps, train, heldout = tiny_setup(n_train=8, n_heldout=4)
    with pytest.raises(ValueError, match="training set is empty"):
        fit(parts, maps, [], heldout, progress=False)
    with pytest.raises(ValueError, match="held-out set is empty"):
        fit(parts, maps, train, [], progress=False)


def test_statistics_are_tiny():
    _, parts, maps, train, _ = tiny_setup(n_train=16)
    adapters = ResidualAdapters(parts, rank=8).attach()
    stats, ce = collect_statistics(parts, adapters, maps, train, range(parts.num_blocks))
    for s in stats.values():
        assert s.gram.shape == (8, 8) and s.cross.shape == (8, 8)
    assert math.isfinite(ce.mean)


def test_absolute_step_scale_is_an_option():
    _, parts, maps, train, heldout = tiny_setup()
    kw = dict(rank=8, etas=[0.01], max_iters=1, patience=1)
    rel = fit(parts, maps, train, heldout, LocaConfig(**kw), progress=False).adapters
    b_rel = rel.get_b()
    rel.detach()
    ab = fit(parts, maps, train, heldout, LocaConfig(step_scale="absolute", **kw), progress=False).adapters
    assert not all(torch.equal(x, y) for x, y in zip(b_rel, ab.get_b(), strict=True))
    ab.detach()
    with pytest.raises(ValueError, match="step_scale"):
        LocaConfig(step_scale="bogus", **kw)

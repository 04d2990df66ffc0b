"""The fit-quality options: adaptive step control, principal-direction A, re-calibration during
the fit and the held-out alignment diagnostic."""

import importlib

import numpy as np
import pytest
import torch
from tiny import sequences, tiny_parts

from loca.config import LocaConfig
from loca.core.ridge import FeedbackFactors, nystrom_top_eigenvectors
from loca.data.batching import make_batches
from loca.eval.evaluation import completion_ce
from loca.method.a_init import principal_a
from loca.method.adapters import ResidualAdapters
from loca.method.calibrate import Calibrator
from loca.method.fit import fit
from loca.method.maps import FeedbackMaps
from loca.method.run import calibrate_maps

stage2_mod = importlib.import_module("loca.method.stage2")


def setup(seed=0, **cfg_kw):
    _, parts = tiny_parts(hidden=32, layers=3)
    train_items, heldout_items = sequences(48, seed=seed), sequences(24, seed=seed + 100)
    cfg = LocaConfig(rank=8, feedback_rank=8, probe_positions=100, **cfg_kw)
    cal = Calibrator(parts, train_items, heldout_items, cfg, pad_id=0)
    train, heldout = make_batches(train_items, 0, 16), make_batches(heldout_items, 0, 16)
    return (
        parts,
        cal,
        calibrate_maps(cal, train, heldout, cfg),
        train,
        heldout,
        cfg,
    )


def count_passes(monkeypatch) -> dict:
    calls = {"n": 0}
    real = stage2_mod.collect_statistics

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(stage2_mod, "collect_statistics", counted)
    return calls


@pytest.mark.integration
def test_adaptive_never_ends_worse_and_retries_on_the_same_statistics(monkeypatch):
    parts, _, maps, train, heldout, cfg = setup(
        step_control="adaptive", etas=[10.0], max_iters=10, patience=6
    )
    calls = count_passes(monkeypatch)
    res = fit(parts, maps, train, heldout, cfg, progress=False)
    rows = [r for r in res.history if r["iteration"] >= 1]
    accepted = [r for r in rows if r["accepted"]]
    assert not rows[0]["accepted"]  # η = 10 overshoots: rejected, then retried smaller
    assert accepted and res.improved and res.heldout_ce < res.frozen_heldout_ce
    assert res.heldout_ce == min(r["heldout_ce"] for r in accepted)
    ces = [r["heldout_ce"] for r in accepted]
    assert ces == sorted(ces, reverse=True)  # every accepted step lowers the held-out CE
    # one training pass per distinct starting B: rejections reuse the statistics
    assert calls["n"] == 1 + len(accepted) - (rows[-1]["accepted"] is True)
    for prev, row in zip(rows, rows[1:], strict=False):
        if not prev["accepted"]:
            assert row["train_ce"] == prev["train_ce"]
    # η shrinks by eta_shrink after a rejection and grows by eta_grow after an acceptance
    for prev, row in zip(rows, rows[1:], strict=False):
        factor = cfg.eta_grow if prev["accepted"] else cfg.eta_shrink
        assert row["eta"] == pytest.approx(prev["eta"] * factor)
    assert completion_ce(parts, heldout).mean == pytest.approx(res.heldout_ce, rel=1e-9)


@pytest.mark.integration
def test_a_rejected_step_restores_b_exactly():
    """Rejections before the first accepted step leave B = 0: the accepted step equals one step
    taken directly with that η from B = 0."""
    parts, _, maps, train, heldout, cfg = setup(
        step_control="adaptive", etas=[10.0], max_iters=10, patience=6
    )
    res = fit(parts, maps, train, heldout, cfg, progress=False)
    rows = [r for r in res.history if r["iteration"] >= 1]
    first = next(r for r in rows if r["accepted"])
    assert first["iteration"] > 1
    b_first = None

    def grab(adapters, row):
        nonlocal b_first
        if row["iteration"] == first["iteration"]:
            b_first = adapters.get_b()

    res.adapters.detach()
    fit(parts, maps, train, heldout, cfg, on_improve=grab, progress=False).adapters.detach()
    direct = fit(
        parts,
        maps,
        train,
        heldout,
        LocaConfig(**{**cfg.to_dict(), "etas": [first["eta"]], "max_iters": 1}),
        progress=False,
    )
    assert all(torch.equal(a, b) for a, b in zip(b_first, direct.adapters.get_b(), strict=True))


@pytest.mark.integration
def test_adaptive_returns_the_frozen_model_when_every_step_is_uphill(monkeypatch):
    parts, _, maps, train, heldout, cfg = setup(step_control="adaptive", max_iters=6, patience=3)
    bad = FeedbackMaps([FeedbackFactors(-1e3 * f.us, f.v) for f in maps.factors], maps.fingerprint)
    calls = count_passes(monkeypatch)
    res = fit(parts, bad, train, heldout, cfg, progress=False)
    assert not res.improved and res.adapters.norm() == 0.0
    assert calls["n"] == 1  # three rejected tries on one pass's statistics
    assert "patience (3)" in next(iter(res.stop_reasons.values()))


@pytest.mark.unit
def test_nystrom_recovers_the_top_eigenvectors():
    gen = torch.Generator().manual_seed(0)
    d, m, rank = 40, 12, 5
    q, _ = torch.linalg.qr(torch.randn(d, m, generator=gen, dtype=torch.float64))
    m_psd = q @ torch.diag(torch.linspace(10, 1, m, dtype=torch.float64)) @ q.T  # rank m ≤ sketch
    omega = torch.randn(d, m, generator=gen, dtype=torch.float64)
    u = nystrom_top_eigenvectors(m_psd @ omega, omega, rank)
    ref = np.linalg.eigh(m_psd.numpy())[1][:, ::-1][:, :rank]
    assert np.allclose(np.abs(ref.T @ u.numpy()), np.eye(rank), atol=1e-8)


@pytest.mark.integration
def test_principal_a_is_deterministic_orthonormal_and_spans_the_top_directions():
    parts, _, _, train, _, _ = setup()
    rank = 22  # sketch width rank + 10 = d: the Nyström step is exact
    a1, a2 = principal_a(parts, train, rank, seed=3), principal_a(parts, train, rank, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a1, a2, strict=True))
    inputs = {}

    def hook(layer):
        def grab(module, args, kwargs, output):
            inputs.setdefault(layer, []).append(args[0] if args else kwargs["hidden_states"])

        return grab

    handles = [b.register_forward_hook(hook(i), with_kwargs=True) for i, b in enumerate(parts.blocks)]
    with torch.no_grad():
        for batch in train:
            parts.final_hidden(batch.input_ids, batch.attention_mask, batch.pos_b, batch.pos_t)
    for h in handles:
        h.remove()
    for layer, a in enumerate(a1):
        a = a.double()
        assert torch.allclose(a @ a.T, torch.eye(rank, dtype=torch.float64), atol=1e-5)
        rows = torch.cat([x[b.pos_b, b.pos_t] for x, b in zip(inputs[layer], train, strict=True)]).double()
        evals, evecs = torch.linalg.eigh(rows.T @ rows)
        top = evecs[:, -rank:]
        # the same subspace: the projection of the exact top-r directions onto A's rows is whole
        assert torch.linalg.matrix_norm(a @ top) ** 2 == pytest.approx(rank, abs=1e-3)


@pytest.mark.integration
def test_principal_a_round_trips_through_the_adapter_file(tmp_path):
    parts, _, maps, train, heldout, cfg = setup(a_init="principal", max_iters=2)
    res = fit(parts, maps, train, heldout, cfg, progress=False)
    assert not torch.equal(res.adapters.A[0], ResidualAdapters(parts, rank=8, seed=0).A[0])
    res.adapters.save_pretrained(tmp_path / "ad")
    res.adapters.detach()
    loaded = ResidualAdapters.from_pretrained(parts, tmp_path / "ad")
    assert all(torch.equal(x, y) for x, y in zip(loaded.A, res.adapters.A, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(loaded.get_b(), res.adapters.get_b(), strict=True))


@pytest.mark.integration
def test_recalibration_refits_the_maps_during_an_adaptive_fit():
    parts, cal, maps, train, heldout, cfg = setup(step_control="adaptive", recalibrate_every=1, max_iters=4)
    res = fit(parts, maps, train, heldout, cfg, calibrator=cal, progress=False)
    accepted = sum(1 for r in res.history if r.get("accepted"))
    assert res.recalibrations == accepted - (
        res.history[-1].get("accepted") and res.history[-1]["iteration"] == 4
    )
    assert res.recalibrations >= 1 and res.recalibration_time_s > 0
    assert res.heldout_ce < res.frozen_heldout_ce
    with pytest.raises(ValueError, match="recalibrate_every"):
        LocaConfig(step_control="fixed", recalibrate_every=2)  # fixed-η trajectories cannot share maps
    with pytest.raises(ValueError, match="Calibrator"):
        fit(parts, maps, train, heldout, cfg, progress=False)


@pytest.mark.integration
def test_alignment_diagnostic_is_recorded_and_changes_nothing():
    parts, cal, maps, train, heldout, cfg = setup(max_iters=3, etas=[0.03])
    plain = fit(parts, maps, train, heldout, cfg, progress=False)
    b_plain = plain.adapters.get_b()
    plain.adapters.detach()
    diag_cfg = LocaConfig(**{**cfg.to_dict(), "alignment_every": 1})
    res = fit(parts, maps, train, heldout, diag_cfg, calibrator=cal, progress=False)
    rows = [r for r in res.history if r.get("diagnostic") == "heldout_alignment"]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(len(r["alignment"]) == parts.num_blocks and -1 <= r["median"] <= 1 for r in rows)
    assert all(torch.equal(a, b) for a, b in zip(b_plain, res.adapters.get_b(), strict=True))
    # at B = 0 the diagnostic equals calibration's own held-out alignment
    res.adapters.reset()
    assert cal.heldout_alignment(maps) == pytest.approx(maps.meta["alignment"]["heldout"], abs=1e-6)


@pytest.mark.integration
def test_pooling_a_probe_with_itself_gives_the_same_maps():
    parts, cal, maps, *_ = setup()
    pool: list = []
    cal.refit(pool)
    twice = cal.refit(pool)  # the same probe at the same state, pooled with itself
    assert twice.meta["probes_pooled"] == 2
    for f, g in zip(maps.factors, twice.factors, strict=True):
        torch.testing.assert_close(f.us @ f.v.T, g.us @ g.v.T, atol=1e-5, rtol=1e-4)


@pytest.mark.integration
def test_calibration_rounds_pool_probes_at_two_adapter_states():
    parts, cal, one_round, train, heldout, cfg = setup(calibration_rounds=2, calibration_round_iters=3)
    maps = calibrate_maps(cal, train, heldout, cfg)
    assert maps.meta["probes_pooled"] == 2 and maps.meta["calibration_rounds"] == 2
    assert getattr(parts.model, "_loca_adapters", None) is None  # the short fit's adapters are gone
    single = Calibrator(
        parts, cal.train, cal.heldout, LocaConfig(**{**cfg.to_dict(), "calibration_rounds": 1}), 0
    )
    assert not torch.allclose(maps.factors[-1].us, single.refit().factors[-1].us)
    res = fit(parts, maps, train, heldout, cfg, progress=False)
    assert res.heldout_ce < res.frozen_heldout_ce

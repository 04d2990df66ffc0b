"""Resuming an interrupted fit: from the state saved after any iteration, :func:`loca.method.fit.fit`
reaches exactly the adapters, selection and history of an uninterrupted fit (CPU, fixed seed)."""

import pytest
import torch
from tiny import sequences, tiny_parts

from loca.config import LocaConfig
from loca.data.batching import make_batches
from loca.method.calibrate import Calibrator
from loca.method.fit import fit
from loca.method.state import load_fit_state, save_fit_state

pytestmark = pytest.mark.integration

TIMING = {"time_s", "elapsed_s"}


class Stop(Exception):
    pass


def setup(**cfg_kw):
    _, parts = tiny_parts(hidden=32, layers=3)
    train_items, heldout_items = sequences(48, seed=0), sequences(24, seed=100)
    cfg = LocaConfig(rank=8, feedback_rank=8, probe_positions=100, **cfg_kw)
    cal = Calibrator(parts, train_items, heldout_items, cfg, pad_id=0)
    train, heldout = make_batches(train_items, 0, 16), make_batches(heldout_items, 0, 16)
    return parts, cal, cal.refit(), train, heldout, cfg


def strip(history):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in history]


@pytest.mark.parametrize(
    "cfg_kw, stop_at",
    [
        (dict(step_control="fixed", etas=[0.01, 0.3], max_iters=6, patience=2), 2),
        (dict(step_control="adaptive", etas=[3.0], max_iters=8, patience=4), 3),
        (dict(step_control="adaptive", etas=[0.05], max_iters=6, recalibrate_every=2, alignment_every=2), 4),
    ],
    ids=["fixed", "adaptive", "recalibrating"],
)
def test_a_resumed_fit_equals_an_uninterrupted_one(tmp_path, cfg_kw, stop_at):
    parts, cal, maps, train, heldout, cfg = setup(**cfg_kw)
    ref = fit(parts, maps, train, heldout, cfg, calibrator=cal, progress=False)
    ref_b = [b.clone() for b in ref.adapters.get_b()]
    ref.adapters.detach()

    def save_then_stop(state):
        save_fit_state(state, tmp_path / "state")
        if state.iteration == stop_at:
            raise Stop

    with pytest.raises(Stop):
        fit(parts, maps, train, heldout, cfg, calibrator=cal, on_checkpoint=save_then_stop, progress=False)
    state = load_fit_state(tmp_path / "state", parts)
    assert state.iteration == stop_at
    if cfg.recalibrate_every:
        assert state.maps is not None and state.recalibrations >= 1
        cal = Calibrator(parts, cal.train, cal.heldout, cfg, pad_id=0)  # a fresh process's calibrator
    res = fit(parts, maps, train, heldout, cfg, calibrator=cal, resume=state, progress=False)
    assert strip(res.history) == strip(ref.history)
    assert (res.best_iteration, res.eta, res.lam_rel, res.heldout_ce) == (
        ref.best_iteration,
        ref.eta,
        ref.lam_rel,
        ref.heldout_ce,
    )
    assert res.stop_reasons == ref.stop_reasons and res.recalibrations == ref.recalibrations
    for b, want in zip(res.adapters.get_b(), ref_b, strict=True):
        assert torch.equal(b, want)
    res.adapters.detach()


def test_a_state_for_another_model_is_refused(tmp_path):
    parts, cal, maps, train, heldout, cfg = setup(max_iters=1)
    fit(
        parts,
        maps,
        train,
        heldout,
        cfg,
        on_checkpoint=lambda s: save_fit_state(s, tmp_path / "s"),
        progress=False,
    ).adapters.detach()
    _, other = tiny_parts(hidden=32, layers=2)
    with pytest.raises(ValueError, match="3 blocks"):
        load_fit_state(tmp_path / "s", other)

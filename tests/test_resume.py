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


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
def test_a_state_is_checked_against_the_run_it_resumes(tmp_path):
    """A state saved with its run's record (model, data content, settings) loads only for the same
    record: other data, other settings or no record at all are refused naming fit_state.json."""
    from loca.models.parts import fingerprint

    parts, cal, maps, train, heldout, cfg = setup(max_iters=2)
    run = {"model": fingerprint(parts), "data": "0" * 64, "loca": cfg.to_dict()}
    res = fit(
        parts,
        maps,
        train,
        heldout,
        cfg,
        on_checkpoint=lambda s: save_fit_state(s, tmp_path / "s", run),
        progress=False,
    )
    res.adapters.detach()
    assert load_fit_state(tmp_path / "s", parts, run).iteration == 2
    with pytest.raises(
        ValueError, match="fit_state.json: this fit state was made with other training/held-out data"
    ):
        load_fit_state(tmp_path / "s", parts, {**run, "data": "1" * 64})
    with pytest.raises(
        ValueError, match=r"other LoCA settings than the run resuming it \(differs in: max_iters, rank\)"
    ):
        load_fit_state(tmp_path / "s", parts, {**run, "loca": {**run["loca"], "rank": 4, "max_iters": 5}})
    save_fit_state(load_fit_state(tmp_path / "s", parts), tmp_path / "bare")  # the API, no record
    with pytest.raises(ValueError, match="fit_state.json: records no model, data and settings"):
        load_fit_state(tmp_path / "bare", parts, run)


@pytest.mark.unit
def test_the_data_fingerprint_is_the_content_not_the_ids():
    from dataclasses import replace

    from loca.data.encoding import content_fingerprint

    train, heldout = sequences(8, seed=0), sequences(4, seed=1)
    base = content_fingerprint(train, heldout)
    assert content_fingerprint([replace(e, source=99) for e in train], heldout) == base  # not ids
    flipped = [
        replace(train[0], completion=(train[0].completion[0] + 1, *train[0].completion[1:])),
        *train[1:],
    ]
    assert content_fingerprint(flipped, heldout) != base  # a changed answer
    assert content_fingerprint(train[:-1], [train[-1], *heldout]) != base  # an example moved over
    assert content_fingerprint([replace(e, has_eos=False) for e in train], heldout) != base

"""MeZO baselines: exact restore, the SPSA estimate against autograd, learning, selection, budgets."""

import importlib
import math

import pytest
import torch
from tiny import sequences, tiny_parts

from loca.baselines.common import completion_loss
from loca.baselines.mezo import (
    ADAPTER_LRS,
    FULL_LRS,
    MezoSettings,
    Spsa,
    fit_adapter_mezo,
    fit_mezo,
    spsa_gradient,
)
from loca.data.batching import make_batches
from loca.eval.evaluation import completion_ce, position_losses
from loca.method.adapters import ResidualAdapters

mezo_mod = importlib.import_module("loca.baselines.mezo")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and a busy machine cannot stall OpenMP spin-waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def setup(dtype=torch.float32, layers=2):
    model, parts = tiny_parts(hidden=32, layers=layers, dtype=dtype)
    train = make_batches(sequences(48, seed=0), pad_id=0, batch_size=16)
    heldout = make_batches(sequences(24, seed=100), pad_id=0, batch_size=16)
    return model, parts, train, heldout


def loss_of(parts, batch):
    def run():
        with torch.inference_mode():
            return completion_loss(parts, batch)

    return run


def frozen_outputs(parts, batches):
    with torch.inference_mode():
        return [position_losses(parts, b) for b in batches]


def same_outputs(parts, batches, expected):
    return all(torch.equal(x, y) for x, y in zip(frozen_outputs(parts, batches), expected, strict=True))


def random_b(adapters, scale=0.05, seed=5):
    gen = torch.Generator().manual_seed(seed)
    adapters.set_b([scale * torch.randn(b.shape, generator=gen) for b in adapters.B])


# --- settings -------------------------------------------------------------------------------


@pytest.mark.unit
def test_settings_validate_and_serialise():
    s = MezoSettings(lrs=[1, 2], eps=[1e-3, 1e-4])
    assert s.lrs == [1.0, 2.0] and s.to_dict()["eps"] == [1e-3, 1e-4]
    assert [(c["lr"], c["eps"]) for c in s.candidates(ADAPTER_LRS)] == [
        (1.0, 1e-3),
        (1.0, 1e-4),
        (2.0, 1e-3),
        (2.0, 1e-4),
    ]
    assert [c["lr"] for c in MezoSettings().candidates(FULL_LRS)] == list(FULL_LRS)
    assert MezoSettings().to_dict() == {
        "lrs": None,
        "eps": [1e-3],
        "max_steps": 2000,
        "time_budget_s": None,
        "eval_every": 100,
        "seed": 0,
        "rank": 32,
    }
    bad = [
        {"lrs": []},
        {"lrs": [0.1, -1]},
        {"lrs": [math.inf]},
        {"eps": []},
        {"eps": [0.0]},
        {"max_steps": 0},
        {"time_budget_s": 0},
        {"eval_every": 0},
        {"rank": 0},
    ]
    for kw in bad:
        with pytest.raises(ValueError, match=f"invalid MezoSettings values: {next(iter(kw))}="):
            MezoSettings(**kw)


# --- the SPSA core: exact restore, seeded noise ---------------------------------------------


@pytest.mark.unit
def test_noise_is_regenerated_from_its_seed():
    t = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.float64)]
    a, b = Spsa(t, seed=1), Spsa(t, seed=1)
    assert torch.equal(a.noise(7, 0), a.noise(7, 0)) and torch.equal(a.noise(7, 1), b.noise(7, 1))
    assert a.noise(7, 1).dtype == torch.float64 and a.noise(7, 0).shape == (3, 4)
    assert not torch.equal(a.noise(7, 0), a.noise(8, 0))
    assert not torch.equal(a.noise(7, 0), Spsa(t, seed=2).noise(7, 0))
    assert not torch.equal(a.noise(7, 0).flatten()[:3], a.noise(7, 1)[:3].float())
    assert a.n_params == 17
    a.perturb(7, 0.5)  # θ += 0.5 z, with the regenerated z
    assert torch.equal(t[0], 0.5 * a.noise(7, 0)) and torch.equal(t[1], 0.5 * a.noise(7, 1))


@pytest.mark.unit
def test_adapter_pair_restores_b_bit_exactly():
    _, parts, train, _ = setup()
    adapters = ResidualAdapters(parts, rank=4, seed=0).attach()
    random_b(adapters)
    tensors = list(adapters.B)
    before = [b.clone() for b in adapters.B]
    spsa = Spsa(adapters.B, seed=3)
    lp, lm = spsa.loss_pair(loss_of(parts, train[0]), step=11, eps=1e-3)
    assert lp != lm  # the pair did see two different models
    assert all(x is y for x, y in zip(adapters.B, tensors, strict=True))
    assert all(torch.equal(b, c) for b, c in zip(adapters.B, before, strict=True))
    # what the backup is for: adding and subtracting εz is not exact in floating point
    spsa.perturb(11, 1e-3)
    spsa.perturb(11, -1e-3)
    assert not all(torch.equal(b, c) for b, c in zip(adapters.B, before, strict=True))
    adapters.detach()


@pytest.mark.parametrize("backup", ["host", "device"])
@pytest.mark.unit
def test_full_pair_restores_weights_bit_exactly_even_after_an_error(backup):
    model, parts, train, _ = setup()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    spsa = Spsa(params, seed=0, backup=backup)
    lp, lm = spsa.loss_pair(loss_of(parts, train[1]), step=1, eps=1e-3)
    assert lp != lm
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return loss_of(parts, train[1])()

    with pytest.raises(RuntimeError, match="boom"):
        spsa.loss_pair(failing, step=2, eps=1e-3)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


# --- the SPSA estimate is the directional derivative ------------------------------------------


@pytest.mark.unit
def test_full_spsa_estimate_is_the_directional_derivative():
    model, parts, train, _ = setup(dtype=torch.float64)
    batch = train[0]
    params = list(model.parameters())
    spsa = Spsa(params, seed=4, backup="host")
    model.requires_grad_(True)
    with torch.enable_grad():
        grads = torch.autograd.grad(completion_loss(parts, batch), params)
    model.requires_grad_(False)
    directional = sum(float((g * spsa.noise(9, i)).sum()) for i, g in enumerate(grads))
    # ε = 1e-4: the O(ε²) error is ~2e-5 here; smaller ε meets the float32 inside Llama's RMSNorm
    lp, lm = spsa.loss_pair(loss_of(parts, batch), step=9, eps=1e-4)
    g = spsa_gradient(lp, lm, 1e-4)
    assert abs(directional) > 1e-2
    assert g == pytest.approx(directional, rel=1e-4)
    # and a small step descends by η g² to first order
    base = float(loss_of(parts, batch)())
    eta = 1e-4 / (g * g)
    spsa.step(loss_of(parts, batch), 9, 1e-4, eta)
    assert float(loss_of(parts, batch)()) - base == pytest.approx(-eta * g * g, rel=1e-2)


@pytest.mark.unit
def test_adapter_spsa_estimate_is_the_directional_derivative():
    _, parts, train, _ = setup(dtype=torch.float64)
    batch = train[0]
    adapters = ResidualAdapters(parts, rank=4, seed=2)
    random_b(adapters)
    spsa = Spsa(adapters.B, seed=6)
    # autograd through hooks of the same form, with B in float64
    b64 = [b.double().requires_grad_() for b in adapters.B]
    a64 = [a.double() for a in adapters.A]

    def hook(layer):
        def fn(module, args, kwargs, output):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = output[0] if isinstance(output, tuple) else output
            h_new = h_out + (h_in @ a64[layer].T) @ b64[layer].T
            return (h_new, *output[1:]) if isinstance(output, tuple) else h_new

        return fn

    handles = [blk.register_forward_hook(hook(i), with_kwargs=True) for i, blk in enumerate(parts.blocks)]
    with torch.enable_grad():
        grads = torch.autograd.grad(completion_loss(parts, batch), b64)
    for h in handles:
        h.remove()
    directional = sum(float((g * spsa.noise(3, i).double()).sum()) for i, g in enumerate(grads))
    with adapters:
        lp, lm = spsa.loss_pair(loss_of(parts, batch), step=3, eps=1e-3)
    assert abs(directional) > 1e-2
    assert spsa_gradient(lp, lm, 1e-3) == pytest.approx(directional, rel=1e-4)


# --- fitting and selection --------------------------------------------------------------------


def check_selection(parts, heldout, res):
    assert res.history[0]["candidate"] is None and res.history[0]["step"] == 0
    assert res.history[0]["heldout_ce"] == res.frozen_heldout_ce
    assert res.heldout_ce == min(r["heldout_ce"] for r in res.history)
    assert completion_ce(parts, heldout).mean == res.heldout_ce  # the best snapshot is in place


@pytest.mark.integration
def test_adapter_mezo_learns_and_keeps_the_best_snapshot():
    _, parts, train, heldout = setup()
    frozen = frozen_outputs(parts, heldout)
    settings = MezoSettings(lrs=[3.0, 30.0], max_steps=100, eval_every=40, rank=4)
    run = fit_adapter_mezo(parts, train, heldout, settings, progress=False)
    res = run.result
    assert res.method == "adapter_mezo" and res.step_unit == "step"
    assert res.improved and res.heldout_ce < res.frozen_heldout_ce - 0.1
    assert res.selected in ({"lr": 3.0, "eps": 1e-3}, {"lr": 30.0, "eps": 1e-3})
    check_selection(parts, heldout, res)
    assert run.adapters.attached and run.adapters.norm() > 0
    rows = [r for r in res.history if r["candidate"] == {"lr": 3.0, "eps": 1e-3}]
    assert [r["step"] for r in rows] == [40, 80, 100]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    d = 2 * 32 * 4
    assert res.extra["n_params"] == d and res.extra["lrs"] == [3.0, 30.0]
    assert res.extra["lrs_scaled"] == [3.0 / math.sqrt(d), 30.0 / math.sqrt(d)]
    assert res.extra["steps_done"] == {"lr=3,eps=0.001": 100, "lr=30,eps=0.001": 100}
    assert set(res.extra["stop_reasons"].values()) == {"max_steps (100)"}
    run.restore()
    assert not run.adapters.attached and same_outputs(parts, heldout, frozen)


@pytest.mark.integration
def test_full_mezo_learns_and_restore_is_bit_exact():
    model, parts, train, heldout = setup()
    original = [p.detach().clone() for p in model.parameters()]
    frozen = frozen_outputs(parts, heldout)
    settings = MezoSettings(lrs=[0.3], max_steps=150, eval_every=50)
    with fit_mezo(parts, train, heldout, settings, progress=False) as run:
        res = run.result
        assert res.method == "mezo" and res.improved
        assert res.heldout_ce < res.frozen_heldout_ce - 0.3
        check_selection(parts, heldout, res)
        assert res.extra["n_params"] == sum(p.numel() for p in original)
        assert not all(torch.equal(p, o) for p, o in zip(model.parameters(), original, strict=True))
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), original, strict=True))
    assert same_outputs(parts, heldout, frozen)


@pytest.mark.integration
def test_frozen_model_is_returned_when_nothing_beats_it(monkeypatch):
    model, parts, train, heldout = setup()
    frozen = frozen_outputs(parts, heldout)
    original = [p.detach().clone() for p in model.parameters()]
    # every step goes uphill (a huge lr is no such guarantee: this random model's frozen CE is
    # worse than a uniform prediction, which a wrecked model can approach)
    monkeypatch.setattr(mezo_mod, "spsa_gradient", lambda lp, lm, eps: -(lp - lm) / (2 * eps))
    settings = MezoSettings(lrs=[3.0, 30.0], max_steps=20, eval_every=10, rank=4)
    run = fit_adapter_mezo(parts, train, heldout, settings, progress=False)
    res = run.result
    assert not res.improved and res.best_step == 0 and res.selected == {}
    assert res.heldout_ce == res.frozen_heldout_ce and len(res.history) == 5
    assert all(r["heldout_ce"] > res.frozen_heldout_ce for r in res.history[1:])
    assert run.adapters.norm() == 0.0 and same_outputs(parts, heldout, frozen)
    run.restore()
    run = fit_mezo(
        parts, train, heldout, MezoSettings(lrs=[0.3], max_steps=20, eval_every=10), progress=False
    )
    assert not run.result.improved and run.result.heldout_ce == run.result.frozen_heldout_ce
    # the frozen weights are back before restore() is even called
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), original, strict=True))
    assert same_outputs(parts, heldout, frozen)
    run.restore()
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), original, strict=True))


@pytest.mark.integration
def test_non_finite_training_loss_stops_the_candidate(monkeypatch):
    _, parts, train, heldout = setup()
    calls = {"n": 0}

    def poisoned(parts_, batch):
        calls["n"] += 1
        loss = completion_loss(parts_, batch)
        return loss * math.nan if calls["n"] == 2 * 30 + 1 else loss  # step 31 of the first candidate

    monkeypatch.setattr(mezo_mod, "completion_loss", poisoned)
    settings = MezoSettings(lrs=[3.0, 30.0], max_steps=40, eval_every=20, rank=4)
    run = fit_adapter_mezo(parts, train, heldout, settings, progress=False)
    res = run.result
    assert res.extra["stop_reasons"]["lr=3,eps=0.001"] == "non-finite training loss at step 31"
    assert res.extra["steps_done"] == {"lr=3,eps=0.001": 30, "lr=30,eps=0.001": 40}
    first = [r["step"] for r in res.history if r["candidate"] == {"lr": 3.0, "eps": 1e-3}]
    assert first == [20, 30]  # the last finite state is evaluated
    check_selection(parts, heldout, res)
    run.restore()


@pytest.mark.integration
def test_an_error_leaves_the_model_as_it_was(monkeypatch):
    model, parts, train, heldout = setup()
    frozen = frozen_outputs(parts, heldout)
    original = [p.detach().clone() for p in model.parameters()]
    calls = {"n": 0}

    def failing(parts_, batch):
        calls["n"] += 1
        if calls["n"] == 25:
            raise KeyboardInterrupt
        return completion_loss(parts_, batch)

    monkeypatch.setattr(mezo_mod, "completion_loss", failing)
    with pytest.raises(KeyboardInterrupt):
        fit_adapter_mezo(parts, train, heldout, MezoSettings(lrs=[3.0], eval_every=5, rank=4), progress=False)
    assert getattr(model, "_loca_adapters", None) is None and same_outputs(parts, heldout, frozen)
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        fit_mezo(parts, train, heldout, MezoSettings(lrs=[0.3], eval_every=5), progress=False)
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), original, strict=True))


# --- budgets and determinism ------------------------------------------------------------------


@pytest.mark.integration
def test_time_budget_stops_each_candidate_early():
    _, parts, train, heldout = setup()
    settings = MezoSettings(lrs=[3.0, 30.0], max_steps=10_000, eval_every=100, time_budget_s=1e-4, rank=4)
    mine = ResidualAdapters(parts, rank=4, seed=9)
    random_b(mine)  # a set passed in is fitted from B = 0 too
    run = fit_adapter_mezo(parts, train, heldout, settings, adapters=mine, progress=False)
    assert run.adapters is mine and mine.attached
    res = run.result
    assert res.extra["steps_done"] == {"lr=3,eps=0.001": 1, "lr=30,eps=0.001": 1}
    assert all(
        r.startswith("time budget (5e-05 s per candidate)") for r in res.extra["stop_reasons"].values()
    )
    assert [r["step"] for r in res.history] == [0, 1, 1]  # each candidate's end is still evaluated
    run.restore()
    fresh = fit_adapter_mezo(
        parts, train, heldout, settings, adapters=ResidualAdapters(parts, 4, seed=9), progress=False
    )
    assert strip_times(fresh.result.history) == strip_times(res.history)
    fresh.restore()


def strip_times(history):
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in history]


@pytest.mark.integration
def test_runs_are_deterministic_on_cpu():
    model, parts, train, heldout = setup()
    settings = MezoSettings(lrs=[3.0], max_steps=30, eval_every=10, rank=4, seed=7)
    runs = []
    for _ in range(2):
        run = fit_adapter_mezo(parts, train, heldout, settings, progress=False)
        runs.append((strip_times(run.result.history), run.adapters.get_b()))
        run.restore()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(x, y) for x, y in zip(runs[0][1], runs[1][1], strict=True))
    reseeded = MezoSettings(**{**settings.to_dict(), "seed": 8})
    other = fit_adapter_mezo(parts, train, heldout, reseeded, progress=False)
    assert strip_times(other.result.history) != runs[0][0]
    other.restore()
    full, short = [], MezoSettings(lrs=[0.3], max_steps=20, eval_every=10)
    for _ in range(2):
        with fit_mezo(parts, train, heldout, short, progress=False) as run:
            full.append((strip_times(run.result.history), [p.detach().clone() for p in model.parameters()]))
    assert full[0][0] == full[1][0]
    assert all(torch.equal(x, y) for x, y in zip(full[0][1], full[1][1], strict=True))

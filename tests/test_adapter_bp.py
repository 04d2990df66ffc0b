"""Adapter-BP: its B gradients against an independent autograd reference (both credits), a frozen
and untouched backbone, selection of the best snapshot, and the settings."""

import pytest
import torch
from tiny import sequences, tiny_parts

from loca.baselines.adapter_bp import AdapterBpSettings, BackpropAdapters, fit_adapter_bp
from loca.baselines.common import completion_loss
from loca.data.batching import make_batches
from loca.eval.evaluation import completion_ce, position_losses
from loca.method.adapters import ResidualAdapters, adapter_a


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def setup(dtype=torch.float32):
    model, parts = tiny_parts(hidden=32, layers=2, dtype=dtype)
    train = make_batches(sequences(48, seed=0), pad_id=0, batch_size=8)
    heldout = make_batches(sequences(24, seed=100), pad_id=0, batch_size=12)
    return model, parts, train, heldout


def random_b(adapters, scale=0.05, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(b.shape, generator=gen) for b in adapters.B]


def reference_grads(parts, a_list, b_list, batch, credit):
    """dL/dB_l in float64 by plain autograd through hooks written here: with ``credit="predict"``
    each block output's gradient is zeroed at the non-predict positions before it meets p_l."""
    bs = [b.detach().double().clone().requires_grad_(True) for b in b_list]
    outs, codes = [], []

    def hook(l):
        def f(module, args, kwargs, output):
            h_in = args[0] if args else kwargs["hidden_states"]
            h_out = output[0] if isinstance(output, tuple) else output
            p = h_in @ a_list[l].double().T  # batch × T × r
            h_new = h_out + p @ bs[l].T
            outs.append(h_new)
            codes.append(p.detach())
            return (h_new, *output[1:]) if isinstance(output, tuple) else h_new

        return f

    handles = [blk.register_forward_hook(hook(l), with_kwargs=True) for l, blk in enumerate(parts.blocks)]
    try:
        with torch.enable_grad():
            loss = completion_loss(parts, batch)
            direct = torch.autograd.grad(loss, bs, retain_graph=True)
            g_out = torch.autograd.grad(loss, outs)  # dL/dh_l, the whole gradient of each block output
    finally:
        for h in handles:
            h.remove()
    mask = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    if credit == "predict":
        mask[batch.pos_b, batch.pos_t] = 1.0
    else:
        mask[:] = 1.0
    via_outputs = [
        torch.einsum("btd,btr->dr", g * mask[..., None], p) for g, p in zip(g_out, codes, strict=True)
    ]
    return loss.detach(), list(direct), via_outputs


@pytest.mark.parametrize("credit", ["all", "predict"])
@pytest.mark.unit
def test_gradients_equal_the_autograd_reference(credit):
    model, parts, train, _ = setup(torch.float64)
    adapters = ResidualAdapters(parts, rank=4, seed=3)
    trainer = BackpropAdapters(adapters, credit)
    b = random_b(adapters)
    trainer.load(b)
    batch = train[0]
    loss, grads = trainer.loss_and_grads(batch)
    ref_loss, direct, via_outputs = reference_grads(parts, adapters.A, b, batch, credit)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
    for g, r in zip(grads, via_outputs, strict=True):
        assert g.dtype == torch.float32 and r.abs().max() > 0
        torch.testing.assert_close(g.double(), r, rtol=1e-6, atol=1e-9)  # float32 B: its rounding
    if credit == "all":  # the masked-nothing reference is autograd's own gradient w.r.t. B
        for d, r in zip(direct, via_outputs, strict=True):
            torch.testing.assert_close(d, r, rtol=1e-10, atol=1e-13)
    else:  # the predict credit is not the whole gradient
        assert not all(torch.allclose(d, r) for d, r in zip(direct, via_outputs, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in trainer.params)  # torch.autograd.grad leaves no .grad


@pytest.mark.integration
def test_a_is_locas_for_the_seed_and_fit_leaves_the_backbone_untouched():
    model, parts, train, heldout = setup()
    model.lm_head.weight.requires_grad_(True)  # a flag of the caller's, given back after the fit
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.inference_mode():
        frozen = [position_losses(parts, b) for b in heldout]
    settings = AdapterBpSettings(lrs=[0.1], epochs=1, eval_every=2, rank=4, seed=7)
    run = fit_adapter_bp(parts, train, heldout, settings, progress=False)
    assert all(torch.equal(a, adapter_a(7, l, 4, 32)) for l, a in enumerate(run.adapters.A))
    assert run.result.improved and run.adapters.attached and run.adapters.norm() > 0
    assert all(p.grad is None for p in model.parameters())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(torch.equal(p, original[n]) for n, p in model.named_parameters())
    run.restore()
    assert not run.adapters.attached
    with torch.inference_mode():
        assert all(torch.equal(position_losses(parts, b), f) for b, f in zip(heldout, frozen, strict=True))


@pytest.mark.integration
def test_selection_restores_the_best_snapshot():
    _, parts, train, heldout = setup()
    # lr 0.3 reaches a lower held-out CE than lr 3.0, which runs last: the last state is not the best
    settings = AdapterBpSettings(lrs=[0.3, 3.0], epochs=3, eval_every=3, rank=4)
    run = fit_adapter_bp(parts, train, heldout, settings, progress=False)
    res = run.result
    assert res.method == "adapter_bp" and res.step_unit == "step"
    assert res.history[0]["candidate"] is None and res.history[0]["heldout_ce"] == res.frozen_heldout_ce
    assert res.heldout_ce == min(r["heldout_ce"] for r in res.history) < res.frozen_heldout_ce
    assert res.history[-1]["heldout_ce"] > res.heldout_ce and res.selected == {"lr": 0.3}
    assert completion_ce(parts, heldout).mean == res.heldout_ce  # the best snapshot is in place
    best = next(r for r in res.history if r["heldout_ce"] == res.heldout_ce)
    assert res.best_step == best["step"]
    steps = [r["step"] for r in res.history if r["candidate"] == {"lr": 3.0}]
    assert steps == [3, 6, 9, 12, 15, 18]  # 6 minibatches × 3 epochs, every 3 steps
    assert res.extra["steps_done"] == {"lr=0.3": 18, "lr=3": 18}
    assert res.extra["n_trainable_params"] == 2 * 32 * 4 and res.extra["credit"] == "all"
    run.restore()


@pytest.mark.integration
def test_runs_are_deterministic_and_credits_differ():
    _, parts, train, heldout = setup()
    results = {}
    for credit in ("all", "all", "predict"):
        settings = AdapterBpSettings(lrs=[0.1], epochs=1, eval_every=3, rank=4, credit=credit)
        with fit_adapter_bp(parts, train, heldout, settings, progress=False) as run:
            ces = [r["heldout_ce"] for r in run.result.history]
            b = run.adapters.get_b()
        if credit in results:
            assert results[credit][0] == ces
            assert all(torch.equal(x, y) for x, y in zip(results[credit][1], b, strict=True))
        results[credit] = (ces, b)
    assert results["all"][0] != results["predict"][0]


@pytest.mark.unit
def test_settings_validate():
    assert AdapterBpSettings().to_dict() == {
        "lrs": [1e-4, 3e-4],
        "epochs": 3,
        "eval_every": 16,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "credit": "all",
        "rank": 32,
        "a_init": "random",
        "seed": 0,
    }
    for bad in (
        {"lrs": []},
        {"lrs": [-1.0]},
        {"epochs": 0},
        {"eval_every": 0},
        {"credit": "some"},
        {"a_init": "pca"},
        {"grad_clip": -1.0},
    ):
        with pytest.raises(ValueError, match="invalid AdapterBpSettings"):
            AdapterBpSettings(**bad)
    with pytest.raises(ValueError, match="unknown"):
        AdapterBpSettings.from_dict({"lr": 1.0})


@pytest.mark.integration
def test_bf16_model_trains_float32_b():
    _, parts, train, heldout = setup(torch.bfloat16)
    settings = AdapterBpSettings(lrs=[0.1], epochs=1, eval_every=3, rank=4, credit="predict")
    with fit_adapter_bp(parts, train, heldout, settings, progress=False) as run:
        assert all(b.dtype == torch.float32 for b in run.adapters.B)
        assert run.result.improved and run.result.heldout_ce < run.result.frozen_heldout_ce
        assert completion_ce(parts, heldout).mean == run.result.heldout_ce

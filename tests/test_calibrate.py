"""Stage I against autograd references on a tiny float64 model."""

import pytest
import torch
import torch.nn.functional as F
from tiny import sequences, tiny_parts

from loca.core.ridge import feedback_factors
from loca.data.batching import make_batches
from loca.method.artefacts import CheckpointMismatchError
from loca.method.calibrate import calibrate
from loca.method.maps import FeedbackMaps
from loca.method.probe import probe_gradients, select_probe


def reference_gradients(model, parts, batch):
    """dLoss/dh_l at predict positions via the model's own logits and an additive probe δ_l."""
    deltas = []

    def add_delta(module, args, output):
        d = torch.zeros_like(output, requires_grad=True)
        deltas.append(d)
        return output + d

    handles = [b.register_forward_hook(add_delta) for b in parts.blocks]
    with torch.enable_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
        logits = out.logits[batch.pos_b, batch.pos_t]
        loss = F.cross_entropy(logits, batch.targets, reduction="sum")
        grads = torch.autograd.grad(loss, deltas)
    for h in handles:
        h.remove()
    return [g[batch.pos_b, batch.pos_t] for g in grads]


@pytest.mark.unit
def test_probe_errors_and_gradients_match_autograd():
    model, parts = tiny_parts()
    items = sequences(10)
    batch = make_batches(items, pad_id=0, batch_size=100)[0]
    e, grads = probe_gradients(parts, batch.items, probe_micro_batch=3, pad_id=0)
    # micro-batching reorders rows; recompute in one batch for the row order of `batch`
    e1, grads1 = probe_gradients(parts, batch.items, probe_micro_batch=100, pad_id=0)
    torch.testing.assert_close(torch.sort(e.sum(1)).values, torch.sort(e1.sum(1)).values.float())
    ref = reference_gradients(model, parts, batch)
    for g, r in zip(grads1, ref, strict=True):
        torch.testing.assert_close(g.double(), r, atol=1e-6, rtol=1e-5)
    # the head error is the gradient at n(h_L): check it with autograd through the real head
    with torch.enable_grad():
        hn = parts.final_hidden(batch.input_ids, batch.attention_mask, batch.pos_b, batch.pos_t)
        hn = hn.detach().requires_grad_(True)
        loss = F.cross_entropy(parts.head(hn), batch.targets, reduction="sum")
        (want,) = torch.autograd.grad(loss, hn)
    torch.testing.assert_close(e1.double(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.integration
def test_calibrate_fits_the_dual_ridge_and_reports_alignment(tmp_path):
    _, parts = tiny_parts()
    items = sequences(40)
    probe = select_probe(items, n_positions=30, seed=0)
    assert sum(len(x.completion) for x in probe) >= 30
    maps = calibrate(parts, probe, sequences(8, seed=9), feedback_rank=4, beta_rel=1e-3, probe_micro_batch=5)
    e, grads = probe_gradients(parts, probe, probe_micro_batch=5, pad_id=0)
    want = feedback_factors(e, grads, 1e-3, 4)
    for f, w in zip(maps.factors, want, strict=True):
        torch.testing.assert_close(f.us @ f.v.T, w.us @ w.v.T, atol=1e-5, rtol=1e-4)
    align = maps.meta["alignment"]
    assert len(align["probe"]) == len(align["heldout"]) == len(align["random"]) == parts.num_blocks
    assert min(align["probe"]) > 0.3  # a rank-4 fit on 30 positions explains much of G
    assert max(abs(x) for x in align["random"]) < min(align["probe"])
    nbytes = sum(f.us.nbytes + f.v.nbytes for f in maps.factors)
    assert nbytes == parts.num_blocks * 2 * 32 * 4 * 4  # factors only: 2·d·k floats per block

    maps.save_pretrained(tmp_path / "maps")
    loaded = FeedbackMaps.from_pretrained(tmp_path / "maps", parts)
    pairs = zip(loaded.factors, maps.factors, strict=True)
    assert all(torch.equal(a.us, b.us) and torch.equal(a.v, b.v) for a, b in pairs)
    assert loaded.meta["alignment"] == maps.meta["alignment"]
    _, other = tiny_parts(seed=3)
    with pytest.raises(CheckpointMismatchError):
        FeedbackMaps.from_pretrained(tmp_path / "maps", other)


@pytest.mark.unit
def test_calibrate_rejects_an_empty_probe():
    _, parts = tiny_parts()
    with pytest.raises(ValueError, match="empty"):
        calibrate(parts, [])


@pytest.mark.unit
def test_probe_keeps_no_parameter_gradients():
    model, parts = tiny_parts()
    probe_gradients(parts, sequences(4), probe_micro_batch=2, pad_id=0)
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())


@pytest.mark.integration
def test_calibration_leaves_parameter_grads_empty_whatever_requires_grad():
    """A model not loaded by ``load_model`` has ``requires_grad`` on every parameter: calibration
    (and a Calibrator with pooled rounds) must neither fill ``.grad`` nor change the flags."""
    from loca.config import LocaConfig
    from loca.data.batching import make_batches
    from loca.method.calibrate import Calibrator
    from loca.method.run import calibrate_maps

    model, parts = tiny_parts()
    model.requires_grad_(True)
    items = sequences(24)
    calibrate(parts, items, sequences(6, seed=3), feedback_rank=4, beta_rel=1e-3, probe_micro_batch=5)
    cfg = LocaConfig(
        feedback_rank=4,
        rank=4,
        probe_positions=30,
        calibration_rounds=2,
        calibration_round_iters=2,
        batch_size=8,
    )
    heldout = sequences(6, seed=3)
    calibrate_maps(
        Calibrator(parts, items, heldout, cfg, pad_id=0),
        make_batches(items, 0, 8),
        make_batches(heldout, 0, 8),
        cfg,
    )
    params = list(model.parameters())
    assert all(p.requires_grad for p in params)
    assert all(p.grad is None for p in params)


@pytest.mark.unit
def test_checkpointed_probe_gives_the_same_gradients_and_recomputes_each_block():
    """Per-block recomputation in the probe: the same errors and gradients (float64), each block
    run twice per micro-batch (forward, then again in the backward), and the blocks' own
    ``forward`` back afterwards."""
    from loca.method.probe import checkpointed

    model, parts = tiny_parts()
    items = sequences(12)
    plain = probe_gradients(parts, items, probe_micro_batch=4, pad_id=0)
    calls = {"n": 0}
    count = lambda *a: calls.__setitem__("n", calls["n"] + 1)  # noqa: E731
    handles = [b.register_forward_pre_hook(count) for b in parts.blocks]
    inner_calls = {"n": 0}
    real = type(parts.blocks[0]).forward

    def counted(self, *args, **kwargs):
        inner_calls["n"] += 1
        return real(self, *args, **kwargs)

    try:
        type(parts.blocks[0]).forward = counted
        recomputed = probe_gradients(parts, items, probe_micro_batch=4, pad_id=0, recompute=True)
    finally:
        type(parts.blocks[0]).forward = real
        for h in handles:
            h.remove()
    torch.testing.assert_close(recomputed[0], plain[0], rtol=0, atol=0)
    for a, b in zip(recomputed[1], plain[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    n_micro = 3
    assert calls["n"] == parts.num_blocks * n_micro  # hooks: once per block and micro-batch
    assert inner_calls["n"] == 2 * parts.num_blocks * n_micro  # the block itself: twice
    assert all("forward" not in b.__dict__ for b in parts.blocks)
    with checkpointed(parts.blocks):
        assert all("forward" in b.__dict__ for b in parts.blocks)
    assert all("forward" not in b.__dict__ for b in parts.blocks)


@pytest.mark.unit
def test_a_memory_budget_bounds_the_probe_micro_batches(monkeypatch):
    """``probe_memory_mb``: a trial step on the longest sequence gives the memory per token; the
    micro-batches then hold at most the tokens that fit, and the rows are the same."""
    import importlib

    import loca.infra.memory

    cal = importlib.import_module("loca.method.probe")
    from loca.method.probe import probe_token_budget

    class FakePeak:  # 0.5 MB per trial: the longest sequence costs 0.5 MB
        def __init__(self, device):
            self.peak_mb = 0.5

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    _, parts = tiny_parts()
    items = sequences(20)
    longest = max(len(it.ids) for it in items)
    monkeypatch.setattr(loca.infra.memory, "PeakMemory", FakePeak)
    assert probe_token_budget(parts, items, 0, True, memory_mb=2.0) == 4 * longest
    assert probe_token_budget(parts, items, 0, True, memory_mb=0.1) == longest  # never below one sequence
    seen = []
    real = cal.make_batches

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(cal, "make_batches", spy)
    plain = probe_gradients(parts, items, probe_micro_batch=16, pad_id=0)
    budget = probe_gradients(parts, items, probe_micro_batch=16, pad_id=0, memory_mb=1.0)
    widest = [max(b.input_ids.numel() for b in batches) for batches in (seen[0], seen[-1])]
    assert widest[1] <= 2 * longest < widest[0]
    torch.testing.assert_close(budget[0], plain[0], rtol=1e-12, atol=1e-12)  # the same rows, in order
    for a, b in zip(budget[1], plain[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

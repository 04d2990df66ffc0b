"""The LoRA baseline on a tiny word-level task: learning, selection, restore, unload, determinism."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from loca.baselines.common import completion_loss
from loca.baselines.lora import LoraRun, LoraSettings, fit_lora
from loca.data.batching import encode, make_batches, pad_token_id
from loca.eval.evaluation import completion_ce
from loca.models.parts import find_parts

pytest.importorskip("peft")

POSITIVE = ["charming", "affecting", "television", "airplane"]
NEGATIVE = ["roof", "refrigerator", "journey", "telephone"]
FILLERS = ["a", "the", "of", "to", "is", "was"]


def examples(fillers: list[str]) -> list[tuple[str, str]]:
    out = []
    for f in fillers:
        for w in POSITIVE + NEGATIVE:
            label = "positive" if w in POSITIVE else "negative"
            out.append((f"Review: {f} {w} . Sentiment (positive or negative):", f" {label}"))
    return out


@pytest.fixture(scope="module")
def task():
    tok = tiny_tokenizer()
    enc = lambda pairs: [encode(tok, p, c, max_length=32, add_eos=True) for p, c in pairs]  # noqa: E731
    pad = pad_token_id(tok)
    train = make_batches(enc(examples(FILLERS[:4])), pad, batch_size=8)
    heldout = make_batches(enc(examples(FILLERS[4:])), pad, batch_size=8)
    return tok, train, heldout


@pytest.fixture
def parts(task):
    return find_parts(tiny_model(task[0], seed=0))


def settings(**kw) -> LoraSettings:
    base = dict(rank=4, alpha=8, lrs=[3e-2], epochs=2)
    return LoraSettings(**{**base, **kw})


def logits(parts, batch) -> torch.Tensor:
    with torch.no_grad():
        return parts.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def module_tree(model) -> list[tuple[str, type, int]]:
    return [(n, type(m), id(m)) for n, m in model.named_modules()]


def weights(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.integration
def test_learns_and_selects(parts, task):
    _, train, heldout = task
    frozen = completion_ce(parts, heldout).mean
    rows = []
    s = settings(lrs=[1e-3, 3e-2], epochs=3)
    with fit_lora(parts, train, heldout, s, progress=False, on_row=rows.append) as run:
        res = run.result
        assert res.method == "lora" and res.step_unit == "epoch"
        assert res.frozen_heldout_ce == frozen  # LoRA injected with B = 0 is the frozen model
        assert res.improved and res.selected["lr"] in (1e-3, 3e-2) and res.best_step >= 1
        assert res.heldout_ce < frozen - 0.5
        assert rows == res.history and len(rows) == 1 + 2 * 3
        assert rows[0]["candidate"] is None and rows[0]["step"] == 0 and rows[0]["train_loss"] is None
        for lr in (1e-3, 3e-2):
            losses = [r["train_loss"] for r in rows if r["candidate"] == {"lr": lr}]
            assert losses[-1] < losses[0]
        # per block, r·(in + out): q, o 32→32; k, v 32→16 (2 key-value heads of 8)
        assert res.extra["n_trainable_params"] == 2 * 4 * (64 + 48 + 48 + 64)
        assert set(res.extra["stop_reasons"]) == {"lr=0.001", "lr=0.03"}
        assert not parts.model.training
        # the best snapshot is what the model carries
        assert completion_ce(parts, heldout).mean == res.heldout_ce
        assert res.heldout_ce == min(r["heldout_ce"] for r in res.history)
    assert not run.attached


@pytest.mark.integration
def test_gradient_is_autograd_of_completion_loss_and_base_is_untouched(parts, task):
    _, train, _ = task
    before = weights(parts.model)
    batch = train[0]
    lr = 1e-4
    # The init fit_lora draws (same seed), and the autograd gradient of the loss on one batch.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref = LoraRun(parts, settings())
    init = ref.state_dict()
    completion_loss(parts, batch).backward()
    grads = {n: p.grad.clone() for n, p in ref.params.items()}
    assert all(p.grad is None for n, p in parts.model.named_parameters() if "lora_" not in n)
    ref.unload()
    assert_same_weights(weights(parts.model), before)

    # One AdamW step (no clipping, no decay): Δ = -lr·g/(|g| + eps), the held-out set = that batch.
    s = settings(lrs=[lr], epochs=1, grad_clip=0.0)
    with fit_lora(parts, [batch], [batch], s, progress=False) as run:
        assert run.result.improved and run.result.best_step == 1
        after = run.state_dict()
        assert all(p.grad is None for p in parts.model.parameters())
    for n, g in grads.items():
        assert torch.count_nonzero(g) == 0 if ".lora_A." in n else torch.count_nonzero(g) > 0  # B = 0
        expected = init[n] - lr * g / (g.abs() + 1e-8)
        torch.testing.assert_close(after[n], expected, rtol=0, atol=1e-7)
    assert_same_weights(weights(parts.model), before)


@pytest.mark.integration
def test_frozen_model_returned_when_nothing_beats_it(parts, task):
    _, train, heldout = task
    frozen_logits = logits(parts, heldout[0])
    run = fit_lora(parts, train, heldout, settings(lrs=[10.0, 1e30]), progress=False)
    res = run.result
    assert not res.improved and res.best_step == 0 and res.selected == {}
    assert res.heldout_ce == res.frozen_heldout_ce == res.history[0]["heldout_ce"]
    worse = [r["heldout_ce"] > res.frozen_heldout_ce or math.isnan(r["heldout_ce"]) for r in res.history]
    assert not worse[0] and all(worse[1:])
    assert res.extra["stop_reasons"]["lr=1e+30"].startswith("non-finite")
    assert run.attached and torch.equal(logits(parts, heldout[0]), frozen_logits)
    assert all(torch.count_nonzero(v) == 0 for n, v in run.state_dict().items() if ".lora_B." in n)
    run.unload()


@pytest.mark.integration
def test_unload_restores_the_model_bit_identically(parts, task):
    _, train, heldout = task
    tree, before, ref = module_tree(parts.model), weights(parts.model), logits(parts, heldout[0])
    run = fit_lora(parts, train, heldout, settings(), progress=False)
    assert run.result.improved
    assert not torch.equal(logits(parts, heldout[0]), ref)
    assert module_tree(parts.model) != tree
    run.unload()
    run.unload()  # idempotent
    assert module_tree(parts.model) == tree
    assert_same_weights(weights(parts.model), before)
    assert torch.equal(logits(parts, heldout[0]), ref)
    assert not any(p.requires_grad for p in parts.model.parameters())
    assert not parts.model.training and not hasattr(parts.blocks, "peft_config")
    # a second fit on the same model works after unload
    fit_lora(parts, train, heldout, settings(epochs=1), progress=False).unload()
    assert module_tree(parts.model) == tree


@pytest.mark.integration
def test_last_iterate_without_selection(parts, task):
    """select=False (lora-paper): the model keeps its last state, which is what the result reports."""
    _, train, heldout = task
    s = settings(lrs=[1.0], epochs=6, eval_every=1, select=False)  # overshoots: the last is not the best
    with fit_lora(parts, train, heldout, s, progress=False) as run:
        res = run.result
        last = res.history[-1]
        assert res.best_step == last["step"] == 6 * len(train) and res.step_unit == "step"
        assert res.heldout_ce == last["heldout_ce"] > min(r["heldout_ce"] for r in res.history)
        assert res.selected == {"lr": 1.0} and res.extra["last_iterate"] is True
        assert res.improved == (res.heldout_ce < res.frozen_heldout_ce)
        assert res.time_to_best_s == last["elapsed_s"]
        assert completion_ce(parts, heldout).mean == last["heldout_ce"]  # the model is at the last step
    with pytest.raises(ValueError, match="one learning rate"):
        LoraSettings(lrs=[1e-3, 1e-2], select=False)


@pytest.mark.parametrize(
    "bad",
    [
        dict(rank=0),
        dict(alpha=0),
        dict(dropout=1.0),
        dict(dropout=-0.1),
        dict(target_modules=[]),
        dict(lrs=[]),
        dict(lrs=[0.0]),
        dict(lrs=[float("nan")]),
        dict(epochs=0),
        dict(eval_every=-1),
        dict(weight_decay=-1.0),
        dict(grad_clip=-1.0),
        dict(seed=-1),
    ],
)
@pytest.mark.unit
def test_bad_settings_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LoraSettings(**bad)


@pytest.mark.unit
def test_settings_round_trip():
    s = LoraSettings(lrs=[1e-3], target_modules=["q_proj"])
    assert LoraSettings.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="unknown"):
        LoraSettings.from_dict({"rnak": 4})


@pytest.mark.integration
def test_missing_target_module_and_double_injection_raise(parts, task):
    _, train, heldout = task
    tree = module_tree(parts.model)
    with pytest.raises(ValueError, match=r"\['c_attn'\] not found.*q_proj"):
        fit_lora(parts, train, heldout, settings(target_modules=["q_proj", "c_attn"]), progress=False)
    assert module_tree(parts.model) == tree
    with pytest.raises(ValueError, match="empty"):
        fit_lora(parts, [], heldout, settings(), progress=False)
    run = fit_lora(parts, train, heldout, settings(epochs=1), progress=False)
    with pytest.raises(ValueError, match="already carry"):
        fit_lora(parts, train, heldout, settings(epochs=1), progress=False)
    run.unload()
    assert module_tree(parts.model) == tree


@pytest.mark.integration
def test_deterministic(task):
    _, train, heldout = task
    results = []
    for _ in range(2):
        parts = find_parts(tiny_model(task[0], seed=0))
        with fit_lora(parts, train, heldout, settings(dropout=0.1, eval_every=3), progress=False) as run:
            results.append((run.result.history, run.state_dict()))
    strip = lambda h: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in h]  # noqa: E731
    assert strip(results[0][0]) == strip(results[1][0])
    assert_same_weights(results[0][1], results[1][1])


@pytest.mark.integration
def test_eval_every_steps_and_dropout(parts, task):
    _, train, heldout = task
    n = len(train)
    with fit_lora(parts, train, heldout, settings(eval_every=3, dropout=0.1), progress=False) as run:
        res = run.result
        assert res.step_unit == "step"
        steps = [r["step"] for r in res.history[1:]]
        expected = list(range(3, 2 * n + 1, 3))
        assert steps == expected + ([2 * n] if expected[-1] != 2 * n else [])
        assert not parts.model.training  # evaluated (and left) in eval mode
        assert completion_ce(parts, heldout).mean == res.heldout_ce


@pytest.mark.integration
def test_bf16_model(task):
    _, train, heldout = task
    parts = find_parts(tiny_model(task[0], seed=0, dtype=torch.bfloat16))
    tree, before, ref = module_tree(parts.model), weights(parts.model), logits(parts, heldout[0])
    frozen = completion_ce(parts, heldout).mean
    with fit_lora(parts, train, heldout, settings(epochs=1), progress=False) as run:
        assert all(p.dtype == torch.float32 for p in run.params.values())
        assert run.result.frozen_heldout_ce == frozen
        assert run.result.improved and run.result.heldout_ce < frozen
    assert module_tree(parts.model) == tree
    assert_same_weights(weights(parts.model), before)
    assert torch.equal(logits(parts, heldout[0]), ref)

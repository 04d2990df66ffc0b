"""CE, ranking accuracy, recovery and evaluation, checked against the model's own forward."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model, tiny_tokenizer

import loca.eval.evaluation as metrics_mod
from loca.data import Example, encode_choices, encode_examples, get_task
from loca.data.batching import Encoded, make_batches, pad_token_id
from loca.eval.evaluation import completion_ce, evaluate
from loca.eval.metrics import (
    TokenCE,
    accuracy_stderr,
    mean_stderr,
    rank_choices,
    ratio_stderr,
    recovery,
    recovery_acc,
    recovery_ce,
)
from loca.method.adapters import ResidualAdapters
from loca.models.parts import find_parts

EXAMPLES = [
    Example(
        question="a charming and often affecting journey . ",
        choices=("negative", "positive"),
        label=1,
        id="e0",
    ),
    Example(question="the man is sitting on a roof", choices=("negative", "positive"), label=0, id="e1"),
    Example(
        question="Which technology was developed most recently ?",
        choices=("cellular telephone", "television", "a b c d e", "airplane"),
        label=0,
        id="e2",
    ),
    Example(question="he starts pulling up roofing", choices=("yes", "no", "g h"), label=2, id="e3"),
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok, seed=0)


@pytest.fixture(scope="module")
def parts(model):
    return find_parts(model)


def ranking_accuracy(parts, batches, n_examples: int, labels: list[int]) -> dict:
    """:func:`rank_choices` of the model as hooked, over batches of every (example, choice)."""
    return rank_choices(metrics_mod.score_choices(parts, batches)[0], n_examples, list(labels))


@pytest.mark.unit
def test_completion_ce_equals_hf_loss(tok, model, parts):
    task = get_task("sst2")
    enc = encode_examples(tok, task, EXAMPLES, max_length=64, add_eos=True)
    batch = make_batches(enc, pad_token_id(tok), batch_size=len(enc))[0]
    ce = completion_ce(parts, [batch])
    labels = torch.full_like(batch.input_ids, -100)
    for row, item in enumerate(enc_sorted := batch.items):
        n_p = len(item.prompt)
        labels[row, n_p : n_p + len(item.completion)] = torch.tensor(item.completion)
    assert len(enc_sorted) == len(EXAMPLES)
    with torch.no_grad():
        hf = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
    assert ce.tokens == int((labels[:, 1:] != -100).sum())
    assert ce.mean == pytest.approx(float(hf.loss), rel=1e-5, abs=1e-6)
    # without EOS: mask the EOS labels
    labels_no_eos = labels.clone()
    labels_no_eos[labels_no_eos == tok.eos_token_id] = -100
    with torch.no_grad():
        hf2 = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels_no_eos)
    assert ce.mean_no_eos == pytest.approx(float(hf2.loss), rel=1e-5, abs=1e-6)


def _brute_force_loglik(model, item: Encoded) -> float:
    ids = torch.tensor([item.ids])
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    n_p = len(item.prompt)
    return sum(float(logp[n_p - 1 + j, t]) for j, t in enumerate(item.completion))


@pytest.mark.unit
def test_ranking_accuracy_matches_unbatched_forward(tok, model, parts):
    task = get_task("arc_easy")
    enc = encode_choices(tok, task, EXAMPLES, max_length=64)
    batches = make_batches(enc, pad_token_id(tok), batch_size=3)
    scores, _ = metrics_mod.score_choices(parts, batches)
    assert len(scores) == len(enc) == sum(len(e.choices) for e in EXAMPLES)
    acc = acc_norm = 0
    for i, ex in enumerate(EXAMPLES):
        ll = [_brute_force_loglik(model, e) for e in enc if e.source == i]
        for c, v in enumerate(ll):
            assert scores[(i, c)][0] == pytest.approx(v, abs=1e-4)
        chars = [len(ch) for ch in ex.choices]
        acc += max(range(len(ll)), key=lambda c: ll[c]) == ex.label
        acc_norm += max(range(len(ll)), key=lambda c: ll[c] / chars[c]) == ex.label
    r = ranking_accuracy(parts, batches, len(EXAMPLES), [ex.label for ex in EXAMPLES])
    assert r["acc"] == acc / len(EXAMPLES) and r["acc_norm"] == acc_norm / len(EXAMPLES)
    # a gold sequence carrying EOS scores the same (EOS is left out of the score)
    with_eos = encode_choices(tok, task, EXAMPLES, max_length=64, eos_on_gold=True)
    scores_eos, ce = metrics_mod.score_choices(
        parts, make_batches(with_eos, pad_token_id(tok), batch_size=5), [e.label for e in EXAMPLES]
    )
    assert scores_eos.keys() == scores.keys()
    for key, (v, n) in scores.items():
        assert scores_eos[key][0] == pytest.approx(v, abs=1e-4) and scores_eos[key][1] == n
    assert ce.tokens == sum(len(e.completion) for e in with_eos if e.has_eos)


@pytest.mark.unit
def test_acc_norm_divides_by_characters_not_tokens(tok, parts, monkeypatch):
    """choice 0: 1 token of 20 characters, loss 5; choice 1: 4 tokens of 7 characters, loss 1
    each. Sum picks 1 (-4 > -5); per token picks 1 (-1 > -5); per character picks 0
    (-0.25 > -0.57)."""
    ex = Example(question="Which ?", choices=("zzzzzzzzzzzzzzzzzzzz", "a b c d"), label=0)
    enc = encode_choices(tok, get_task("arc_easy"), [ex], max_length=64)
    assert [len(e.completion) for e in enc] == [1, 4] and [e.n_chars for e in enc] == [20, 7]
    z = tok.convert_tokens_to_ids("zzzzzzzzzzzzzzzzzzzz")

    def fake_losses(parts, batch):
        return torch.where(batch.targets == z, 5.0, 1.0)

    monkeypatch.setattr(metrics_mod, "position_losses", fake_losses)
    batches = make_batches(enc, pad_token_id(tok), batch_size=2)
    r = ranking_accuracy(parts, batches, 1, [0])
    assert r["acc"] == 0.0 and r["acc_norm"] == 1.0
    # and by token count it would have been choice 1
    per_token = [-5.0 / 1, -4.0 / 4]
    assert max(range(2), key=lambda c: per_token[c]) == 1


@pytest.mark.unit
def test_rank_choices_validation_and_ties():
    scores = {(0, 0): (-1.0, 2), (0, 1): (-1.0, 2), (1, 0): (-3.0, 100), (1, 1): (-2.0, 10)}
    r = rank_choices(scores, 2, [0, 1])
    assert {k: r[k] for k in ("acc", "acc_norm", "n")} == {"acc": 1.0, "acc_norm": 0.5, "n": 2}
    assert r["correct"] == [True, True] and r["correct_norm"] == [True, False]  # tie -> first
    assert r["acc_stderr"] == 0.0 and r["acc_norm_stderr"] == pytest.approx(0.5)  # sd 0.7071/√2
    one = rank_choices({(0, 0): (-1.0, 1), (0, 1): (-2.0, 1)}, 1, [0])
    assert one["acc"] == 1.0 and math.isnan(one["acc_stderr"]) and math.isnan(one["acc_norm_stderr"])
    with pytest.raises(ValueError, match="expected 0..n-1"):
        rank_choices({(0, 1): (-1.0, 1)}, 1, [0])
    with pytest.raises(ValueError, match="expected 0..n-1"):
        rank_choices({(0, 0): (-1.0, 1)}, 2, [0, 0])
    with pytest.raises(ValueError, match="labels"):
        rank_choices(scores, 2, [0])


# --- standard errors ---------------------------------------------------------------------------


@pytest.mark.unit
def test_mean_stderr_is_lm_evals_sample_sd_over_sqrt_n():
    rng = np.random.default_rng(0)
    for n in (2, 3, 17, 200):
        x = rng.normal(1.0, 2.0, n)
        ref = float(np.std(x, ddof=1, dtype=np.float64) / np.sqrt(n))
        assert mean_stderr(list(x)) == pytest.approx(ref, rel=1e-12)
        assert mean_stderr(list(x)) == pytest.approx(statistics.stdev(x) / math.sqrt(n), rel=1e-12)
        bits = rng.random(n) < 0.3
        ref_bits = float(np.std(bits.astype(np.float64), ddof=1) / np.sqrt(n))
        assert accuracy_stderr(list(bits)) == pytest.approx(ref_bits, rel=1e-12, abs=0.0)
    # lm-eval's own formula, written out: sqrt(sum((x - mean)^2) / (n - 1)) / sqrt(n)
    xs = [1.0, 0.0, 1.0, 1.0]
    mu = sum(xs) / len(xs)
    lm_eval = math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) / math.sqrt(len(xs))
    assert accuracy_stderr([True, False, True, True]) == pytest.approx(lm_eval, rel=1e-15)
    assert accuracy_stderr([True] * 5) == 0.0
    # n = 1: the sample sd is undefined (lm-eval reports "N/A"); n = 0 likewise
    assert math.isnan(mean_stderr([0.7])) and math.isnan(accuracy_stderr([True]))
    assert math.isnan(mean_stderr([]))


@pytest.mark.unit
def test_ratio_stderr_is_the_clustered_se_of_the_per_token_mean():
    rng = np.random.default_rng(1)
    for n in (2, 5, 60):
        lengths = rng.integers(1, 8, n)
        tokens = [rng.gamma(2.0, 1.5, k) for k in lengths]  # per-token losses of each example
        y, x = [float(t.sum()) for t in tokens], [float(k) for k in lengths]
        # reference: OLS of every token's loss on a constant, sandwich variance clustered by
        # example, with the small-sample factor G/(G-1)
        z = np.concatenate(tokens)
        beta = z.mean()
        scores = np.array([(t - beta).sum() for t in tokens])
        ref = math.sqrt(n / (n - 1) * float(scores @ scores)) / len(z)
        assert ratio_stderr(y, x) == pytest.approx(ref, rel=1e-12)
        # the delta-method form: (1/x̄) * sqrt(Σ(y_i − R x_i)² / (n(n−1)))
        r = sum(y) / sum(x)
        resid = np.array(y) - r * np.array(x)
        delta = math.sqrt(float(resid @ resid) / (n * (n - 1))) / np.mean(x)
        assert ratio_stderr(y, x) == pytest.approx(delta, rel=1e-12)
        # one token per example: exactly lm-eval's mean_stderr of the losses
        assert ratio_stderr(y, [1.0] * n) == pytest.approx(mean_stderr(y), rel=1e-12)
    assert math.isnan(ratio_stderr([3.0], [2.0])) and math.isnan(ratio_stderr([0.0, 0.0], [0, 0]))
    with pytest.raises(ValueError, match="2 sums for 1 counts"):
        ratio_stderr([1.0, 2.0], [1.0])


@pytest.mark.unit
def test_token_ce_keeps_per_example_sums():
    ce = TokenCE()
    ce.add(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([False, False, True]), torch.tensor([4, 4, 4]))
    ce.add(torch.tensor([0.5, 1.5]), torch.tensor([False, True]), torch.tensor([1, 1]))
    ce.add(torch.tensor([2.0]), torch.tensor([False]), torch.tensor([4]))  # more of example 4
    assert ce.per_example == {4: [8.0, 4.0, 5.0, 3.0], 1: [2.0, 2.0, 0.5, 1.0]}
    assert ce.mean == pytest.approx(10.0 / 6) and ce.mean_no_eos == pytest.approx(5.5 / 4)
    assert ce.stderr == pytest.approx(ratio_stderr([8.0, 2.0], [4.0, 2.0]))
    assert ce.stderr_no_eos == pytest.approx(ratio_stderr([5.0, 0.5], [3.0, 1.0]))
    plain = TokenCE()
    plain.add(torch.tensor([1.0, 2.0]), torch.tensor([False, False]))  # no sources: no stderr
    assert plain.per_example == {} and math.isnan(plain.stderr)


@pytest.mark.unit
def test_recovery_forms_and_flags():
    assert recovery_ce(2.0, 1.5, 1.0) == pytest.approx(0.5)
    assert recovery_ce(2.0, 0.8, 1.0) == pytest.approx(1.2)
    assert recovery_acc(0.5, 0.7, 0.9) == pytest.approx(0.5)
    assert recovery(0.5, 0.7, 0.9, higher_is_better=True) == recovery_acc(0.5, 0.7, 0.9)
    # near-zero denominators (the paper's ARC-Easy cell 2.444 -> 2.438) are flagged
    assert recovery_ce(2.444, 1.642, 2.438) is None
    assert recovery_acc(0.80, 0.85, 0.805) is None
    # LoRA worse than frozen: the ratio would flip sign, so it is flagged too
    assert recovery_ce(2.0, 1.5, 2.5) is None
    assert recovery_acc(0.824, 0.84, 0.636) is None
    assert recovery_ce(float("nan"), 1.0, 0.5) is None
    assert recovery_ce(2.444, 1.642, 2.438, tol=1e-4) == pytest.approx(0.802 / 0.006)
    assert recovery_acc(0.5, 0.6, 0.5) is None  # LoRA no better than frozen
    # a gain of one or two test items is too small for a ratio, counted exactly (0.71 - 0.70 is
    # 0.010000000000000009 in floating point, just above the one-point tolerance)
    assert recovery_acc(0.70, 0.76, 0.71) == pytest.approx(6.0)
    assert recovery_acc(0.70, 0.76, 0.71, n_test=100) is None
    assert recovery_acc(0.70, 0.82, 0.74, n_test=50) is None  # 2 items of 50
    assert recovery_acc(0.70, 0.82, 0.76, n_test=50) == pytest.approx(2.0)  # 3 items


@pytest.mark.unit
def test_evaluate_runs_the_model_as_hooked(tok, parts):
    task = get_task("arc_easy")
    kw = dict(max_length=64, batch_size=2, add_eos=True)
    frozen = evaluate(parts, tok, task, EXAMPLES, **kw)
    assert set(frozen) >= {"test_ce", "test_ce_no_eos", "acc", "acc_norm", "n_test", "padding_fraction"}
    assert frozen["n_test"] == len(EXAMPLES) and frozen["n_truncated"] == 0
    assert 0.0 <= frozen["padding_fraction"] < 1.0
    assert frozen["test_ce"] != frozen["test_ce_no_eos"]
    enc = encode_examples(tok, task, EXAMPLES, 64, True)
    ce = completion_ce(parts, make_batches(enc, pad_token_id(tok), 2))
    assert frozen["test_ce"] == pytest.approx(ce.mean) and frozen["n_tokens"] == ce.tokens
    assert frozen["test_ce_no_eos"] == pytest.approx(ce.mean_no_eos)
    batches = make_batches(encode_choices(tok, task, EXAMPLES, 64), pad_token_id(tok), 3)
    ranking = ranking_accuracy(parts, batches, len(EXAMPLES), [ex.label for ex in EXAMPLES])
    assert (frozen["acc"], frozen["acc_norm"]) == (ranking["acc"], ranking["acc_norm"])
    assert frozen["n_sequences"] == sum(len(ex.choices) for ex in EXAMPLES)
    # standard errors: acc from per-example correctness, CE as a ratio over examples
    assert frozen["acc_stderr"] == pytest.approx(accuracy_stderr(ranking["correct"]), rel=1e-12)
    assert frozen["acc_norm_stderr"] == pytest.approx(accuracy_stderr(ranking["correct_norm"]))
    assert frozen["acc_stderr"] == pytest.approx(
        float(np.std(np.array(ranking["correct"], float), ddof=1) / 2.0), rel=1e-12
    )
    one_by_one = [completion_ce(parts, make_batches([e], pad_token_id(tok), 1)) for e in enc]
    for key, attr in (("test_ce_stderr", "total"), ("test_ce_no_eos_stderr", "total_no_eos")):
        counts = [c.tokens if attr == "total" else c.tokens_no_eos for c in one_by_one]
        ref = ratio_stderr([getattr(c, attr) for c in one_by_one], counts)
        assert frozen[key] == pytest.approx(ref, rel=1e-5) and ref > 0
    no_eos = evaluate(parts, tok, task, EXAMPLES, max_length=64, batch_size=2, add_eos=False)
    assert no_eos["test_ce"] == pytest.approx(no_eos["test_ce_no_eos"])
    assert no_eos["test_ce"] == pytest.approx(frozen["test_ce_no_eos"], rel=1e-5)

    adapters = ResidualAdapters(parts, rank=4, seed=0)
    gen = torch.Generator().manual_seed(1)
    adapters.set_b([torch.randn(b.shape, generator=gen) for b in adapters.B])
    with adapters:
        adapted = evaluate(parts, tok, task, EXAMPLES, **kw)
    assert adapted["test_ce"] != pytest.approx(frozen["test_ce"])
    again = evaluate(parts, tok, task, EXAMPLES, **kw)
    assert again == frozen


@pytest.mark.unit
def test_evaluate_reports_truncation(tok, parts):
    ex = Example(question=" ".join(["the"] * 80), choices=("yes", "no"), label=0)
    m = evaluate(parts, tok, get_task("arc_easy"), [ex], max_length=16, batch_size=4, add_eos=True)
    assert m["n_truncated"] == 1 and math.isfinite(m["test_ce"])
    for key in ("acc_stderr", "acc_norm_stderr", "test_ce_stderr", "test_ce_no_eos_stderr"):
        assert math.isnan(m[key])  # a single example: no standard error


# --- CLI ---------------------------------------------------------------------------------------


@pytest.mark.integration
def test_cli_tasks(capsys):
    from loca.cli.main import main

    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("sst2", "boolq", "arc_easy", "arc_challenge", "obqa", "hellaswag"))
    assert main(["tasks", "--show", "sst2", "--data-dir", "/nonexistent"]) == 0
    out = capsys.readouterr().out
    assert "Review: {question}" in out and "Sentiment (positive or negative):" in out
    assert "' positive'" in out
    assert main(["tasks", "--show", "nope"]) == 2
    assert "known tasks" in capsys.readouterr().err


@pytest.mark.integration
def test_cli_evaluate_writes_results(tmp_path, tok, model, capsys):
    from loca.cli.main import main

    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "data" / "arc_easy"
    data.mkdir(parents=True)
    (data / "validation.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "id": ex.id,
                    "question": ex.question,
                    "passage": None,
                    "choices": list(ex.choices),
                    "label": ex.label,
                }
            )
            + "\n"
            for ex in EXAMPLES
        )
    )
    (data / "train.jsonl").write_text((data / "validation.jsonl").read_text().replace('"e', '"t'))
    out = tmp_path / "out"
    args = [
        "evaluate",
        "--model",
        str(model_dir),
        "--task",
        "arc_easy",
        "--data-dir",
        str(tmp_path / "data"),
        "--n-test",
        "3",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "acc_norm" in printed and "padding" in printed
    res = json.loads((out / "results.json").read_text())
    assert res["n_test"] == 3 and len(res["test_set"]["test"]["ids"]) == 3
    assert res["task"]["name"] == "arc_easy" and res["adapter"] is None

    # with saved adapters
    parts = find_parts(model)
    adapters = ResidualAdapters(parts, rank=4, seed=0)
    adapters.set_b([torch.full(b.shape, 0.05) for b in adapters.B])
    adapters.save_pretrained(tmp_path / "adapter")
    assert main([*args[:-1], str(tmp_path / "out2"), "--adapter", str(tmp_path / "adapter")]) == 0
    res2 = json.loads((tmp_path / "out2" / "results.json").read_text())
    assert res2["adapter_norm"] > 0
    assert res2["test_ce"] != pytest.approx(res["test_ce"])
    assert res2["test_set"]["test"]["ids"] == res["test_set"]["test"]["ids"]

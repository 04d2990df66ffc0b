"""Evaluation metrics as pure functions: standard errors, token CE sums, ranking accuracy from
scores, recovery ratios. Running a model to get the scores is :mod:`loca.eval.evaluation`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# --- standard errors (lm-evaluation-harness conventions) ------------------------------------


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of a mean as lm-evaluation-harness reports it (``lm_eval.api.metrics.
    mean_stderr``): the sample standard deviation (ddof = 1) over ``sqrt(n)``.

    NaN for fewer than two values: the harness's formula divides by ``n − 1 = 0`` there, and its
    evaluator reports ``"N/A"`` instead of a number.
    """
    n = len(values)
    if n < 2:
        return float("nan")
    mu = math.fsum(values) / n
    return math.sqrt(math.fsum((float(x) - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


def accuracy_stderr(correct: Sequence[bool | float]) -> float:
    """Standard error of ``acc`` or ``acc_norm`` from per-example correctness (0/1), as
    lm-evaluation-harness reports it: :func:`mean_stderr` of the 0/1 values (NaN for n < 2)."""
    return mean_stderr([float(c) for c in correct])


def ratio_stderr(sums: Sequence[float], counts: Sequence[float]) -> float:
    """Standard error of a ratio of sums ``R = Σ y_i / Σ x_i`` over independent examples ``i``
    (per-token CE: ``y_i`` the summed loss of example i, ``x_i`` its token count).

    The delta-method (linearisation) standard error of a ratio estimator, clustered by example::

        SE(R) = sqrt( n/(n−1) · Σ_i (y_i − R·x_i)² ) / Σ_i x_i

    the cluster-robust standard error of the mean per-token loss with each example's tokens as
    one cluster (tokens of one answer are not independent). With every ``x_i = 1`` it is exactly
    :func:`mean_stderr` of the ``y_i``. NaN for fewer than two examples or no tokens.
    """
    n = len(sums)
    if n != len(counts):
        raise ValueError(f"{n} sums for {len(counts)} counts")
    total = math.fsum(counts)
    if n < 2 or total == 0:
        return float("nan")
    r = math.fsum(sums) / total
    resid = math.fsum((float(y) - r * float(x)) ** 2 for y, x in zip(sums, counts, strict=True))
    return math.sqrt(n / (n - 1) * resid) / total


@dataclass
class TokenCE:
    """Summed cross-entropy over completion tokens, with and without the trained EOS.

    When :meth:`add` is given each position's example, ``per_example`` keeps ``[loss, tokens,
    loss without EOS, tokens without EOS]`` per example, for the standard errors.
    """

    total: float = 0.0
    tokens: int = 0
    total_no_eos: float = 0.0
    tokens_no_eos: int = 0
    per_example: dict[int, list[float]] = field(default_factory=dict)

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else float("nan")

    @property
    def mean_no_eos(self) -> float:
        return self.total_no_eos / self.tokens_no_eos if self.tokens_no_eos else float("nan")

    @property
    def stderr(self) -> float:
        """:func:`ratio_stderr` of :attr:`mean` over examples (NaN unless examples were given)."""
        v = list(self.per_example.values())
        return ratio_stderr([e[0] for e in v], [e[1] for e in v])

    @property
    def stderr_no_eos(self) -> float:
        """:func:`ratio_stderr` of :attr:`mean_no_eos` over examples."""
        v = list(self.per_example.values())
        return ratio_stderr([e[2] for e in v], [e[3] for e in v])

    def add(self, losses: torch.Tensor, is_eos: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """Add per-position ``losses``; ``sources`` (optional) is each position's example index."""
        losses = losses.double()
        is_eos = is_eos.to(losses.device)
        self.total += float(losses.sum())
        self.tokens += losses.numel()
        keep = ~is_eos
        self.total_no_eos += float(losses[keep].sum())
        self.tokens_no_eos += int(keep.sum())
        if sources is None:
            return
        ids, inverse = torch.unique(sources.to(losses.device), return_inverse=True)
        sums = torch.zeros(len(ids), 4, dtype=torch.float64, device=losses.device)
        values = torch.stack([losses, torch.ones_like(losses), losses * keep, keep.double()], dim=1)
        sums.index_add_(0, inverse, values)
        for i, row in zip(ids.tolist(), sums.cpu().tolist(), strict=True):
            acc = self.per_example.setdefault(i, [0.0, 0.0, 0.0, 0.0])
            for k in range(4):
                acc[k] += row[k]


# --- ranking accuracy ----------------------------------------------------------------------


def _first_argmax(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def rank_choices(
    scores: dict[tuple[int, int], tuple[float, int]], n_examples: int, labels: list[int]
) -> dict:
    """``acc`` and ``acc_norm`` from per-choice ``(loglik, n_chars)`` scores (pure function).

    ``acc``: the argmax of the summed log-likelihood is the label. ``acc_norm``: the argmax of
    log-likelihood / number of characters of the choice text is the label (lm-evaluation-harness).
    Ties go to the lowest choice index, as ``numpy.argmax`` does. Returns ``acc``, ``acc_norm``,
    ``n``, the per-example correctness ``correct`` and ``correct_norm`` (lists of bool, in example
    order) and ``acc_stderr``, ``acc_norm_stderr`` (:func:`accuracy_stderr`).
    """
    if len(labels) != n_examples:
        raise ValueError(f"{len(labels)} labels for {n_examples} examples")
    if n_examples < 1:
        raise ValueError("no examples to rank")
    per_example: list[dict[int, tuple[float, int]]] = [{} for _ in range(n_examples)]
    for (src, choice), value in scores.items():
        if not 0 <= src < n_examples:
            raise ValueError(f"score for example {src}, but there are {n_examples} examples")
        per_example[src][choice] = value
    correct: list[bool] = []
    correct_norm: list[bool] = []
    for i, choices in enumerate(per_example):
        k = len(choices)
        if sorted(choices) != list(range(k)) or k == 0:
            raise ValueError(f"example {i}: choices scored {sorted(choices)}, expected 0..n-1")
        if not 0 <= labels[i] < k:
            raise ValueError(f"example {i}: label {labels[i]} out of range for {k} choices")
        ll = [choices[c][0] for c in range(k)]
        norm = [choices[c][0] / max(choices[c][1], 1) for c in range(k)]
        correct.append(_first_argmax(ll) == labels[i])
        correct_norm.append(_first_argmax(norm) == labels[i])
    return {
        "acc": sum(correct) / n_examples,
        "acc_norm": sum(correct_norm) / n_examples,
        "n": n_examples,
        "correct": correct,
        "correct_norm": correct_norm,
        "acc_stderr": accuracy_stderr(correct),
        "acc_norm_stderr": accuracy_stderr(correct_norm),
    }


# --- recovery ------------------------------------------------------------------------------

RECOVERY_TOL = 0.01
RECOVERY_MIN_ITEMS = 2  # an accuracy gain of at most this many test items is too small for a ratio
RECOVERY_FLAG = "‡"  # printed in place of a recovery ratio whose denominator is (near) zero


def recovery(
    frozen: float,
    method: float,
    lora: float,
    *,
    higher_is_better: bool = False,
    tol: float = RECOVERY_TOL,
) -> float | None:
    """``(method − frozen) / (lora − frozen)``: the share of LoRA's improvement that a method gets.

    For CE (``higher_is_better=False``) it is ``R_CE = (CE_frozen − CE_m)/(CE_frozen − CE_LoRA)``,
    for accuracy ``R_acc = (acc_m − acc_frozen)/(acc_LoRA − acc_frozen)`` -- the same expression,
    ``(m − f)/(l − f)``; only the direction of improvement (for the flag) differs.

    Returns None -- *flagged*, to be shown as :data:`RECOVERY_FLAG`, not as a number -- when
    LoRA's improvement over the frozen model is at most ``tol · max(1, |frozen|)`` (so near zero
    *or negative*: the ratio would be meaningless or have its sign flipped), or when an input is
    not finite. With the default tol that is one accuracy point, or 1% of a frozen CE above 1 nat.
    """
    values = (frozen, method, lora)
    if any(v is None or not math.isfinite(v) for v in values):
        return None
    gain = (lora - frozen) if higher_is_better else (frozen - lora)
    if gain <= tol * max(1.0, abs(frozen)):
        return None
    return (method - frozen) / (lora - frozen)


def recovery_ce(ce_frozen: float, ce_method: float, ce_lora: float, *, tol: float = RECOVERY_TOL):
    """``R_CE``: the share of LoRA's CE gain over the frozen model a method gets; None when flagged
    (see :func:`recovery`)."""
    return recovery(ce_frozen, ce_method, ce_lora, higher_is_better=False, tol=tol)


def recovery_acc(
    acc_frozen: float,
    acc_method: float,
    acc_lora: float,
    *,
    tol: float = RECOVERY_TOL,
    n_test: int | None = None,
    min_items: int = RECOVERY_MIN_ITEMS,
):
    """``R_acc``: the share of LoRA's accuracy gain over the frozen model a method gets; None when
    flagged (see :func:`recovery`). With ``n_test`` (the number of test items the accuracies are
    over) it is also flagged when LoRA's gain is at most ``min_items`` items (counted exactly, not
    in floating point): a ratio over one or two items says nothing (one item more for the method
    would move it by a half or more)."""
    if n_test and acc_lora is not None and acc_frozen is not None and math.isfinite(acc_lora - acc_frozen):
        if round((acc_lora - acc_frozen) * n_test) <= min_items:
            return None
    return recovery(acc_frozen, acc_method, acc_lora, higher_is_better=True, tol=tol)

"""Evaluation metrics computed from hidden states at the needed positions only."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .data.batching import Batch
from .head import head_loss_and_error
from .models import ModelParts


@dataclass
class TokenCE:
    """Summed cross-entropy over completion tokens, with and without the trained EOS."""

    total: float = 0.0
    tokens: int = 0
    total_no_eos: float = 0.0
    tokens_no_eos: int = 0

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else float("nan")

    @property
    def mean_no_eos(self) -> float:
        return self.total_no_eos / self.tokens_no_eos if self.tokens_no_eos else float("nan")

    def add(self, losses: torch.Tensor, is_eos: torch.Tensor) -> None:
        losses = losses.double()
        is_eos = is_eos.to(losses.device)
        self.total += float(losses.sum())
        self.tokens += losses.numel()
        keep = ~is_eos
        self.total_no_eos += float(losses[keep].sum())
        self.tokens_no_eos += int(keep.sum())


def position_losses(parts: ModelParts, batch: Batch) -> torch.Tensor:
    """Per-predict-position cross-entropy of the model as currently hooked (N,)."""
    b = batch.to(parts.device)
    hn = parts.final_hidden(b.input_ids, b.attention_mask, b.pos_b, b.pos_t)
    loss, _ = head_loss_and_error(
        hn, parts.head.weight, parts.head.bias, b.targets, parts.transform, need_error=False
    )
    return loss


@torch.inference_mode()
def completion_ce(parts: ModelParts, batches: Iterable[Batch]) -> TokenCE:
    """Mean per-token CE over the completion tokens of ``batches`` (EOS included and excluded)."""
    losses, eos = [], []
    for batch in batches:  # no host sync inside the loop
        losses.append(position_losses(parts, batch))
        eos.append(batch.is_eos)
    ce = TokenCE()
    ce.add(torch.cat(losses), torch.cat(eos))
    return ce


# --- ranking accuracy ----------------------------------------------------------------------


@torch.inference_mode()
def score_choices(
    parts: ModelParts, batches: Iterable[Batch], labels: list[int] | None = None
) -> tuple[dict[tuple[int, int], tuple[float, int]], TokenCE]:
    """One pass over choice sequences: per-choice log-likelihoods and the gold completions' CE.

    The score of a choice is the summed log-likelihood of its tokens after the prompt, EOS
    excluded, so a gold sequence that carries EOS serves both ranking and CE. Returns
    ``({(source, choice): (loglik, n_chars)}, TokenCE over the gold sequences)``; the CE is empty
    when ``labels`` is None.
    """
    out: dict[tuple[int, int], tuple[float, int]] = {}
    ce = TokenCE()
    for batch in batches:
        loss = position_losses(parts, batch).double().cpu()
        keep = (~batch.is_eos).double()
        sums = torch.zeros(len(batch.items), dtype=torch.float64)
        sums.index_add_(0, batch.pos_b, -loss * keep)
        for row, item in enumerate(batch.items):
            key = (item.source, item.choice)
            if item.source < 0 or item.choice < 0:
                raise ValueError("choice sequences need source and choice set (use encode_choices)")
            if key in out:
                raise ValueError(f"choice {item.choice} of example {item.source} appears twice")
            out[key] = (float(sums[row]), item.n_chars)
        if labels is not None:
            gold = torch.tensor([it.choice == labels[it.source] for it in batch.items])
            at_gold = gold[batch.pos_b]
            ce.add(loss[at_gold], batch.is_eos[at_gold])
    return out, ce


def choice_loglik(parts: ModelParts, batches: Iterable[Batch]) -> dict[tuple[int, int], tuple[float, int]]:
    """Summed log-likelihood of each choice's tokens after its prompt (EOS excluded), batched.

    Returns ``{(source, choice): (loglik, n_chars)}`` for every sequence in ``batches``.
    """
    return score_choices(parts, batches)[0]


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
    Ties go to the lowest choice index, as ``numpy.argmax`` does.
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
    correct = correct_norm = 0
    for i, choices in enumerate(per_example):
        k = len(choices)
        if sorted(choices) != list(range(k)) or k == 0:
            raise ValueError(f"example {i}: choices scored {sorted(choices)}, expected 0..n-1")
        if not 0 <= labels[i] < k:
            raise ValueError(f"example {i}: label {labels[i]} out of range for {k} choices")
        ll = [choices[c][0] for c in range(k)]
        norm = [choices[c][0] / max(choices[c][1], 1) for c in range(k)]
        correct += _first_argmax(ll) == labels[i]
        correct_norm += _first_argmax(norm) == labels[i]
    return {"acc": correct / n_examples, "acc_norm": correct_norm / n_examples, "n": n_examples}


def ranking_accuracy(
    parts: ModelParts, batches_of_choices: Iterable[Batch], n_examples: int, labels: list[int]
) -> dict:
    """Ranking accuracy of the model as currently hooked: ``{"acc", "acc_norm", "n"}``.

    ``batches_of_choices`` hold one sequence per (example, choice), as made by
    :func:`loca.data.encoding.encode_choices` and :func:`loca.data.batching.make_batches`;
    every choice of every example must be present.
    """
    return rank_choices(choice_loglik(parts, batches_of_choices), n_examples, list(labels))


# --- recovery ------------------------------------------------------------------------------

RECOVERY_TOL = 0.01
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
    """``R_CE`` (SPEC §5); None when flagged (see :func:`recovery`)."""
    return recovery(ce_frozen, ce_method, ce_lora, higher_is_better=False, tol=tol)


def recovery_acc(acc_frozen: float, acc_method: float, acc_lora: float, *, tol: float = RECOVERY_TOL):
    """``R_acc`` (SPEC §5); None when flagged (see :func:`recovery`)."""
    return recovery(acc_frozen, acc_method, acc_lora, higher_is_better=True, tol=tol)


def format_recovery(value: float | None, digits: int = 2) -> str:
    """A recovery ratio for printing: the number, or :data:`RECOVERY_FLAG` when flagged."""
    return RECOVERY_FLAG if value is None else f"{value:.{digits}f}"


def recovery_report(frozen: dict, method: dict, lora: dict, *, tol: float = RECOVERY_TOL) -> dict:
    """``R_CE`` (from ``test_ce``) and ``R_acc`` (from ``acc``) of three :func:`evaluate` results;
    each is a float or None, with ``*_flagged`` telling which were flagged."""
    r_ce = recovery_ce(frozen["test_ce"], method["test_ce"], lora["test_ce"], tol=tol)
    r_acc = recovery_acc(frozen["acc"], method["acc"], lora["acc"], tol=tol)
    return {
        "R_CE": r_ce,
        "R_CE_flagged": r_ce is None,
        "R_acc": r_acc,
        "R_acc_flagged": r_acc is None,
    }


# --- evaluation ----------------------------------------------------------------------------


def evaluate(
    parts: ModelParts,
    tokenizer,
    task,
    examples,
    *,
    max_length: int,
    batch_size: int,
    add_eos: bool,
) -> dict:
    """CE over gold completion tokens (with and without EOS) and ranking accuracy on ``examples``.

    Runs the model as it currently is (with whatever adapters are attached). Returns
    ``test_ce`` (mean per-token CE over completion tokens, EOS included when ``add_eos``),
    ``test_ce_no_eos``, ``acc``, ``acc_norm``, ``n_test``, ``padding_fraction`` (share of padded
    positions in the batches run), ``n_sequences``, ``n_tokens`` (gold completion tokens scored
    for CE) and ``n_truncated`` (examples whose prompt was cut from the left to fit).

    Every choice of an example is scored after the same prompt tokens (see
    :func:`loca.data.encoding.encode_choices`). Without truncation, ``test_ce`` equals
    :func:`completion_ce` over :func:`loca.data.encoding.encode_examples`; with it, the gold
    prompt may keep a token or so less (the shortest prompt any choice needs).
    """
    from .data.batching import make_batches, pad_token_id, padding_fraction
    from .data.encoding import count_truncated, encode_choices

    examples = list(examples)
    if not examples:
        raise ValueError("no examples to evaluate")
    labels = [ex.label for ex in examples]
    # One sequence per (example, choice); the gold one carries EOS when add_eos, so its pass
    # gives both the CE and the gold choice's score (the EOS loss is left out of the score).
    items = encode_choices(tokenizer, task, examples, max_length, eos_on_gold=add_eos)
    batches = make_batches(items, pad_token_id(tokenizer), batch_size)
    scores, ce = score_choices(parts, batches, labels)
    ranking = rank_choices(scores, len(examples), labels)
    gold = [it for it in items if it.choice == labels[it.source]]
    return {
        "test_ce": ce.mean,
        "test_ce_no_eos": ce.mean_no_eos,
        "acc": ranking["acc"],
        "acc_norm": ranking["acc_norm"],
        "n_test": len(examples),
        "padding_fraction": padding_fraction(batches),
        "n_sequences": len(items),
        "n_tokens": ce.tokens,
        "n_truncated": count_truncated(tokenizer, task, examples, gold),
    }

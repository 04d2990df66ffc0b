"""Running the model for evaluation: per-position losses at the predict positions only, held-out
CE, choice scores, and the test metrics (CE with and without EOS, acc, acc_norm, standard errors).
The pure metric functions are in :mod:`loca.eval.metrics`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from tqdm.auto import tqdm

from ..core.head import head_loss_and_error
from ..data.batching import Batch
from ..infra import distributed
from ..models.parts import ModelParts
from .metrics import TokenCE, rank_choices


def position_losses(parts: ModelParts, batch: Batch) -> torch.Tensor:
    """Per-predict-position cross-entropy of the model as currently hooked (N,)."""
    b = batch.to(parts.device)
    hn = parts.final_hidden(b.input_ids, b.attention_mask, b.pos_b, b.pos_t)
    loss, _ = head_loss_and_error(
        hn, parts.head.weight, parts.head.bias, b.targets, parts.transform, need_error=False
    )
    return loss


class Replays(Protocol):
    """Captured per-batch passes (:class:`loca.method.graphs.BatchGraphs`): ``run(index, fn)``
    returns ``fn(batch index)``'s outputs from its replayed graph."""

    def run(self, index: int, fn, key=()) -> tuple: ...


@torch.inference_mode()
def completion_ce(parts: ModelParts, batches: Sequence[Batch], graphs: Replays | None = None) -> TokenCE:
    """Mean per-token CE over the completion tokens of ``batches`` (EOS included and excluded).
    ``graphs``: CUDA graphs made for these ``batches`` (:class:`loca.method.graphs.BatchGraphs`).
    Data-parallel: each rank runs its share of the batches and the sums are reduced."""
    losses, eos = [], []
    for index in distributed.owned(len(batches)):  # no host sync inside the loop
        if graphs is not None:  # the graph's buffer is rewritten by its next replay: copied
            losses.append(graphs.run(index, lambda b: (position_losses(parts, b),))[0].clone())
        else:
            losses.append(position_losses(parts, batches[index]))
        eos.append(batches[index].is_eos.to(losses[-1].device))
    ce = TokenCE()
    if losses:
        ce.add(torch.cat(losses), torch.cat(eos))
    return reduce_ce(ce)


def reduce_ce(ce: TokenCE, per_example: bool = False) -> TokenCE:
    """``ce`` summed over the ranks; with ``per_example`` (sums kept per example, by
    :meth:`TokenCE.add` with sources) the per-example sums are merged too: each example lives on
    one rank. Every rank must pass the same ``per_example`` (a rank with no batch has none of
    its own), or the ranks would wait in different collectives."""
    if not distributed.active():
        return ce
    if not per_example:
        sums = distributed.all_reduce_numbers([ce.total, ce.tokens, ce.total_no_eos, ce.tokens_no_eos])
        return TokenCE(sums[0], int(sums[1]), sums[2], int(sums[3]))
    out = TokenCE()
    for part in distributed.gather_objects(ce):
        out.total += part.total
        out.tokens += part.tokens
        out.total_no_eos += part.total_no_eos
        out.tokens_no_eos += part.tokens_no_eos
        out.per_example.update(part.per_example)
    return out


@torch.inference_mode()
def score_choices(
    parts: ModelParts, batches: Sequence[Batch], labels: list[int] | None = None, progress: bool = False
) -> tuple[dict[tuple[int, int], tuple[float, int]], TokenCE]:
    """One pass over choice sequences: per-choice log-likelihoods and the gold completions' CE.

    The score of a choice is the summed log-likelihood of its tokens after the prompt, EOS
    excluded, so a gold sequence that carries EOS serves both ranking and CE. Returns
    ``({(source, choice): (loglik, n_chars)}, TokenCE over the gold sequences)``; the CE is empty
    when ``labels`` is None, and keeps per-example sums (``TokenCE.per_example``, by source).
    Data-parallel: each rank scores its share of the batches and the results are gathered.
    """
    out: dict[tuple[int, int], tuple[float, int]] = {}
    ce = TokenCE()
    mine = distributed.shard(batches)
    shown = tqdm(
        mine, desc="evaluate", unit="batch", leave=False, disable=not progress or not distributed.is_main()
    )
    for batch in shown:
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
            source = torch.tensor([it.source for it in batch.items])[batch.pos_b]
            at_gold = gold[batch.pos_b]
            ce.add(loss[at_gold], batch.is_eos[at_gold], source[at_gold])
    if distributed.active():
        scores: dict = {}
        for part in distributed.gather_objects(out):
            scores.update(part)
        out = scores
    return out, reduce_ce(ce, per_example=labels is not None)


def evaluate(
    parts: ModelParts,
    tokenizer,
    task,
    examples,
    *,
    max_length: int,
    batch_size: int,
    add_eos: bool,
    progress: bool = False,
) -> dict:
    """CE over gold completion tokens (with and without EOS) and ranking accuracy on ``examples``
    (``progress``: a progress bar over the batches).

    Runs the model as it currently is (with whatever adapters are attached). Returns
    ``test_ce`` (mean per-token CE over completion tokens, EOS included when ``add_eos``),
    ``test_ce_no_eos``, ``acc``, ``acc_norm``, ``n_test``, ``padding_fraction`` (share of padded
    positions in the batches run), ``n_sequences``, ``n_tokens`` (gold completion tokens scored
    for CE) and ``n_truncated`` (examples whose prompt was cut from the left to fit), and the
    standard errors ``acc_stderr``, ``acc_norm_stderr`` (:func:`accuracy_stderr`, as
    lm-evaluation-harness) and ``test_ce_stderr``, ``test_ce_no_eos_stderr``
    (:func:`ratio_stderr` over examples); each is NaN for a single example.

    Every choice of an example is scored after the same prompt tokens (see
    :func:`loca.data.encoding.encode_choices`). Without truncation, ``test_ce`` equals
    :func:`completion_ce` over :func:`loca.data.encoding.encode_examples`; with it, the gold
    prompt may keep a token or so less (the shortest prompt any choice needs).
    """
    from ..data.batching import make_batches, pad_token_id, padding_fraction
    from ..data.encoding import count_truncated, encode_choices
    from ..data.splits import content_sha256

    examples = list(examples)
    if not examples:
        raise ValueError("no examples to evaluate")
    distributed.check_same("evaluation examples", content_sha256(examples))
    labels = [ex.label for ex in examples]
    # One sequence per (example, choice); the gold one carries EOS when add_eos, so its pass
    # gives both the CE and the gold choice's score (the EOS loss is left out of the score).
    items = encode_choices(tokenizer, task, examples, max_length, eos_on_gold=add_eos)
    batches = make_batches(items, pad_token_id(tokenizer), batch_size)
    scores, ce = score_choices(parts, batches, labels, progress=progress)
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
        "acc_stderr": ranking["acc_stderr"],
        "acc_norm_stderr": ranking["acc_norm_stderr"],
        "test_ce_stderr": ce.stderr,
        "test_ce_no_eos_stderr": ce.stderr_no_eos,
    }

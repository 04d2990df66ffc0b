"""The calibration probe: true hidden-state gradients of the head loss at the predict positions
(one backward pass over a seeded subset of the training sequences), with the head errors they
belong to, and the synthetic errors that widen a probe."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from ..core.head import head_loss_and_error
from ..data.batching import Encoded, make_batches
from ..infra import distributed
from ..models.parts import ModelParts, at_positions


@contextmanager
def checkpointed(blocks) -> Iterator[None]:
    """Run every block under ``torch.utils.checkpoint`` (non-reentrant) inside the ``with`` body:
    the backward recomputes a block's internals instead of keeping them. Hooks on the blocks run
    as before (they wrap the checkpointed call); the original ``forward`` comes back after."""
    saved = []
    for block in blocks:
        own = block.__dict__.get("forward")  # set on the instance, e.g. by accelerate's hooks
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        saved.append((block, own))
    try:
        yield
    finally:
        for block, own in saved:
            if own is None:
                del block.forward
            else:
                block.forward = own


def probe_gradients(
    parts: ModelParts,
    items: Sequence[Encoded],
    probe_micro_batch: int,
    pad_id: int,
    progress: bool = False,
    recompute: bool = False,
    memory_mb: float = 0.0,
    synthetic: int = 0,
    seed: int = 0,
) -> tuple[Tensor, list[Tensor]]:
    """Head errors E (N×d) and true block-output gradients G_l (N×d) at every predict position.

    One forward and one backward pass per micro-batch: the backward starts from ``n(h_L)`` with the
    exact head error as its incoming gradient, so no logits enter the autograd graph, and no
    parameter gradient is computed or stored (the backward runs to the input embeddings only,
    whatever the parameters' ``requires_grad``: a model loaded elsewhere keeps ``.grad`` None).
    Peak memory is that of one micro-batch's forward+backward; with ``recompute`` (see
    :func:`checkpointed`) only the block boundaries and one block's internals are kept. With
    ``memory_mb`` > 0 a micro-batch also holds at most the padded tokens that fit that budget,
    from the peak of a trial step on the longest sequence (:func:`probe_token_budget`). Rows come
    in the same order whatever the micro-batches (sequences sorted by length).

    With ``synthetic`` = K > 0, each micro-batch's forward also carries K more backward passes of
    synthetic head errors (:func:`synthetic_errors`), and their rows follow the natural ones: set
    k of K after set k − 1, each in the natural rows' order (``(K + 1)·N`` rows in all).
    """
    errors: list[Tensor] = []
    grads: list[list[Tensor]] = [[] for _ in parts.blocks]
    max_tokens = probe_token_budget(parts, items, pad_id, recompute, memory_mb) if memory_mb > 0 else None
    batches = make_batches(items, pad_id, batch_size=probe_micro_batch, max_tokens=max_tokens)
    draws = synthetic_tokens(items, [b.n_positions for b in batches], synthetic, seed)
    mine = distributed.owned(len(batches))  # data-parallel: this rank's micro-batches
    shown = tqdm(
        mine,
        desc="calibrate",
        unit="micro-batch",
        leave=False,
        disable=not progress or not distributed.is_main(),
    )
    for index in shown:
        # each set of errors as one leading slice: natural first, then the synthetic sets
        e, captured = _probe_step(parts, batches[index], recompute, draws[index])
        errors.append(e)
        for i in range(parts.num_blocks):  # with the head error: the ridge fits pair them
            grads[i].append(captured[i].to(e.device))
    if distributed.active():  # every rank gets every row, in the one-process order
        device = parts.device
        pairs = enumerate(zip(mine, errors, strict=True))
        rows = {i: (e.cpu(), [g[k].cpu() for g in grads]) for k, (i, e) in pairs}
        for part in distributed.gather_objects(rows):
            rows.update(part)
        ordered = [rows[i] for i in range(len(batches))]
        errors = [e.to(device) for e, _ in ordered]
        grads = [[gs[l].to(device) for _, gs in ordered] for l in range(parts.num_blocks)]
    rows = lambda parts_: torch.cat(parts_, dim=1).flatten(0, 1)  # noqa: E731  (sets × N) rows, set-major
    return rows(errors), [rows(g) for g in grads]


def synthetic_tokens(
    items: Sequence[Encoded],
    rows: Sequence[int],
    synthetic: int,
    seed: int,
) -> list[Tensor]:
    """For each micro-batch (``rows`` predict positions each, in order), ``synthetic`` × rows tokens j
    drawn uniformly from the probe's target tokens, seeded: the same draw for a position whatever
    the micro-batches (one draw over all rows, then split)."""
    if not synthetic:
        return [torch.empty(0, n, dtype=torch.long) for n in rows]
    vocab = torch.tensor(sorted({t for it in items for t in it.completion}))
    digest = hashlib.sha256(f"loca-synthetic:{seed}".encode()).digest()[:8]
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    j = vocab[torch.randint(len(vocab), (synthetic, sum(rows)), generator=gen)]
    return list(j.split(list(rows), dim=1))


def synthetic_errors(head_weight: Tensor, targets: Tensor, tokens: Tensor) -> Tensor:
    """Head errors ``W_u[j] − W_u[y]`` (K×N×d) of a model that put all its mass on another answer
    token j (``tokens``, K×N). They are probe directions, not errors the model makes: the block
    gradient is linear in the error at a fixed state (``g_l = J_l(h)ᵀ e``), so their exact gradients
    teach a map that relation along the directions the errors take once the answer format is learned
    (the competition between answer tokens)."""
    w = head_weight.detach()
    return w[tokens.to(w.device)].float() - w[targets].float()


def _probe_step(
    parts: ModelParts,
    batch,
    recompute: bool,
    tokens: Tensor | None = None,
) -> tuple[Tensor, dict[int, Tensor]]:
    """One micro-batch's head errors and block-output gradients at its predict positions, each with a
    leading dimension of 1 + K error sets: the natural one and, for ``tokens`` (K×N, see
    :func:`synthetic_tokens`), K synthetic ones (one backward pass each through one forward)."""
    b = batch.to(parts.device)
    embed = parts.model.get_input_embeddings()
    captured: dict[int, Tensor] = {}
    make_hook = partial(_grad_capture_hook, captured, b.pos_b, b.pos_t)
    handles = [blk.register_forward_hook(make_hook(i)) for i, blk in enumerate(parts.blocks)]
    sets: list[dict[int, Tensor]] = []
    try:
        with torch.enable_grad(), checkpointed(parts.blocks) if recompute else nullcontext():
            embeds = embed(b.input_ids).detach().requires_grad_(True)
            hn = parts.final_hidden(b.input_ids, b.attention_mask, b.pos_b, b.pos_t, inputs_embeds=embeds)
            with torch.no_grad():
                _, e = head_loss_and_error(
                    hn.detach(), parts.head.weight, parts.head.bias, b.targets, parts.transform
                )
                errors = [e.float()]
                if tokens is not None and len(tokens):
                    errors += list(synthetic_errors(parts.head.weight, b.targets, tokens))
            for k, err in enumerate(errors):
                hn.backward(err.to(hn.dtype), inputs=[embeds], retain_graph=k < len(errors) - 1)
                sets.append(dict(captured))
    finally:
        for h in handles:
            h.remove()
    if any(len(c) != parts.num_blocks for c in sets):
        raise RuntimeError(f"captured gradients for {len(sets[-1])} of {parts.num_blocks} blocks")
    stacked_sets = {l: torch.stack([c[l] for c in sets]) for l in range(parts.num_blocks)}
    return torch.stack(errors), stacked_sets


def probe_token_budget(
    parts: ModelParts, items: Sequence[Encoded], pad_id: int, recompute: bool, memory_mb: float
) -> int | None:
    """The padded tokens a probe micro-batch may hold within ``memory_mb``: one trial step on the
    longest sequence measures the peak per token (GPU: allocated memory; CPU: sampled RSS), and
    the budget is scaled from it, never below that one sequence. None when the trial shows no
    measurable growth (everything fits)."""
    from ..infra.memory import PeakMemory

    longest = max(items, key=lambda it: len(it.ids))
    trial = make_batches([longest], pad_id, batch_size=1)[0]
    with PeakMemory(parts.device) as mem:
        _probe_step(parts, trial, recompute)
    tokens = len(longest.ids)
    if not mem.peak_mb > 0:
        return None
    return max(tokens, int(memory_mb / (mem.peak_mb / tokens)))


def probe_roles(items: Sequence[Encoded], pad_id: int) -> Tensor:
    """The role (:data:`loca.data.batching.ROLES`) of each row :func:`probe_gradients` returns
    for ``items`` (rows come in one order whatever the micro-batches)."""
    return make_batches(items, pad_id, batch_size=len(items))[0].roles


def _grad_capture_hook(captured: dict[int, Tensor], pos_b: Tensor, pos_t: Tensor, layer: int):
    """A forward hook that stores dLoss/dh_layer at the predict positions during backward."""

    def save_grad(g: Tensor) -> None:
        captured[layer] = at_positions(g, pos_b, pos_t).detach().float()

    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        out.register_hook(save_grad)

    return hook


def select_probe(items: Sequence[Encoded], n_positions: int, seed: int) -> list[Encoded]:
    """A seeded subset of ``items`` with at least ``n_positions`` predict positions (or all)."""
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen, total = [], 0
    for i in order:
        if total >= n_positions:
            break
        chosen.append(items[i])
        total += len(items[i].completion)
    return chosen

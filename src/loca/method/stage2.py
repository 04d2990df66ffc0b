"""One Stage II pass: a forward pass that records each block's statistics, then the ridge solves.

During the pass every block records ``p = A h_{l-1}`` at the predict positions (:class:`Recorder`);
the head error ``e`` gives the local targets through the credit (:class:`loca.method.credit.Credit`,
the feedback maps by default). Only ``G = Σ p pᵀ`` (r×r) and ``Σ s·Y P`` (k×r) persist per block.
The new B is linear in η given a pass's statistics, so a step can be retried with another η on the
same statistics (:func:`stage2_pass`'s ``first``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..config import LocaConfig
from ..core import stacked
from ..core.head import head_loss_and_error
from ..core.ridge import BlockStats, solve_block
from ..data.batching import Batch
from ..eval.evaluation import reduce_ce
from ..eval.metrics import TokenCE
from ..infra import distributed
from ..models.parts import ModelParts
from .adapters import ResidualAdapters
from .credit import Credit
from .graphs import BatchGraphs


class Recorder:
    """Collects, during one forward pass, each recorded block's adapter codes ``p = A h_{l-1}``
    (float32) and input norm ``||h_{l-1}||²`` at the predict positions.

    A hook only gathers the block's input rows (N×d, the hidden dtype: one kernel); whenever the
    rows waiting on a device reach ``budget_mb`` they are turned into codes and norms for all of
    those blocks at once (a few batched kernels), so a pass holds at most that much of them and a
    GPU pays few launches for recording."""

    def __init__(
        self,
        pos_b: Tensor,
        pos_t: Tensor,
        width: int,
        stacks: dict[torch.device, tuple[list[int], Tensor]],
        budget_mb: float = 1.0,
    ):
        """``width``: the batch's padded length T (flat index ``b·T + t`` of a position);
        ``stacks``: per device, the blocks recorded there in forward order and their A stacked
        (L×r×d, float32)."""
        flat = pos_b * width + pos_t
        self.flat = {flat.device: flat}  # per device: moved once, not once per block
        self.budget = budget_mb * 2**20
        self.where = {l: (dev, i) for dev, (ls, _) in stacks.items() for i, l in enumerate(ls)}
        self.a = {dev: a for dev, (_, a) in stacks.items()}
        self.waiting: dict[torch.device, list[tuple[int, Tensor]]] = {dev: [] for dev in stacks}
        self.done: dict[torch.device, list[tuple[Tensor, Tensor]]] = {dev: [] for dev in stacks}

    def wants(self, layer: int) -> bool:
        return layer in self.where

    def record(self, layer: int, h_in: Tensor) -> None:
        dev, i = self.where[layer]
        flat = self.flat.get(h_in.device)
        if flat is None:
            flat = self.flat[h_in.device] = next(iter(self.flat.values())).to(h_in.device)
        waiting = self.waiting[dev]
        waiting.append((i, h_in.reshape(-1, h_in.shape[-1]).index_select(0, flat)))
        if sum(r.numel() * r.element_size() for _, r in waiting) >= self.budget:
            self._encode(dev)

    def _encode(self, dev: torch.device) -> None:
        waiting = self.waiting[dev]
        if not waiting:
            return
        first = waiting[0][0]
        if [i for i, _ in waiting] != list(range(first, first + len(waiting))):
            raise RuntimeError("blocks were recorded out of their forward order")
        h = torch.stack([r for _, r in waiting]).float()  # G × N × d
        codes = h @ self.a[dev][first : first + len(waiting)].mT
        self.done[dev].append((codes, torch.linalg.vector_norm(h, dim=(-2, -1)).square()))
        waiting.clear()

    def codes_and_norms(self, dev: torch.device) -> tuple[Tensor, Tensor]:
        """``(p, ||h||²)`` of the blocks recorded on ``dev``: codes L×N×r and norms (L)."""
        self._encode(dev)
        done = self.done[dev]
        return torch.cat([c for c, _ in done]), torch.cat([n for _, n in done])


def block_groups(num_blocks: int, groups: int) -> list[list[int]]:
    """Split blocks 0..L-1 into ``groups`` contiguous, near-equal groups (input side first)."""
    groups = min(groups, num_blocks)
    bounds = [round(i * num_blocks / groups) for i in range(groups + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(groups)]


def _by_device(adapters: ResidualAdapters, blocks: Sequence[int]) -> dict[torch.device, list[int]]:
    """``blocks`` grouped by the device they live on (in order)."""
    out: dict[torch.device, list[int]] = {}
    for l in blocks:
        out.setdefault(adapters.devices[l], []).append(l)
    return out


def _batch_outputs(
    parts: ModelParts,
    adapters: ResidualAdapters,
    credit: Credit,
    b: Batch,
    by_device: dict[torch.device, list[int]],
    consts: dict[torch.device, tuple[Tensor, Tensor]],
) -> tuple[Tensor, list[tuple[Tensor, Tensor, Tensor]]]:
    """The per-batch part of a Stage II pass (what a CUDA graph captures): the forward with the
    adapters and the recording hooks, the head loss and error, and per device the codes
    ``p`` (L×N×r), input norms² (L) and projected errors ``y = E V_k`` (L×N×k)."""
    stacks = {dev: (ls, consts[dev][1]) for dev, ls in by_device.items()}
    with adapters.recording(Recorder(b.pos_b, b.pos_t, b.input_ids.shape[1], stacks)) as rec:
        hn = parts.final_hidden(b.input_ids, b.attention_mask, b.pos_b, b.pos_t)
    loss, e = head_loss_and_error(hn, parts.head.weight, parts.head.bias, b.targets, parts.transform)
    mask = credit.mask(b.roles)  # gated maps: each position's own map's columns
    outs = []
    for dev, ls in by_device.items():
        v_all = consts[dev][0]
        p, h_sumsq = rec.codes_and_norms(dev)
        e_dev = e if e.device == dev else e.to(dev)
        y = (e_dev @ v_all.to(e_dev.dtype)).view(-1, len(ls), v_all.shape[1] // len(ls)).transpose(0, 1)
        if mask is not None:
            y = y * mask.to(device=dev, dtype=y.dtype)
        outs.append((p, h_sumsq, y))
    return loss, outs


@torch.inference_mode()
def collect_statistics(
    parts: ModelParts,
    adapters: ResidualAdapters,
    credit: Credit,
    batches: Sequence[Batch],
    blocks: Sequence[int],
    step_scale: str = "rms",
    graphs: BatchGraphs | None = None,
) -> tuple[dict[int, BlockStats], TokenCE]:
    """One forward pass: per-block statistics for ``blocks`` and the training CE before the update.

    The hooks only gather each block's input rows at the predict positions (one kernel per
    block); the codes p = A h and input norms are formed for a few blocks at a time
    (:class:`Recorder`), the statistics of all blocks on a device as one stack,
    and nothing is copied to the host inside the loop, so a GPU never waits on Python. With
    ``graphs`` (made for these ``batches``) each batch's forward, head error and codes replay a
    CUDA graph. Data-parallel: each rank runs its share of the batches, and the statistics and
    CE sums are all-reduced once (float64) after the pass.
    """
    by_device = _by_device(adapters, blocks)
    k = credit.width  # gated maps: their columns side by side
    stats = {dev: BlockStats.zeros(adapters.rank, k, dev, blocks=len(ls)) for dev, ls in by_device.items()}
    sigma = {dev: torch.stack([credit.sigma(l) for l in ls]) for dev, ls in by_device.items()}  # L × k
    consts = {  # per device: all V_k side by side (d × L·k), A stacked (L × r × d); views, not copies
        dev: (
            stacked.cat([credit.projection(l) for l in ls], dim=1),
            stacked.stack([adapters.A[l] for l in ls]),
        )
        for dev, ls in by_device.items()
    }
    if graphs is not None:  # a graph reads them from fixed buffers (one device)
        consts = {dev: graphs.fixed(tuple(blocks), *c) for dev, c in consts.items()}

    def outputs(batch: Batch) -> tuple:
        return _batch_outputs(parts, adapters, credit, batch, by_device, consts)

    losses, eos = [], []
    for index in distributed.owned(len(batches)):
        if graphs is not None:
            loss, outs = graphs.run(index, outputs, key=tuple(blocks))
            loss = loss.clone()  # the graph's buffer is rewritten by its next replay
        else:
            loss, outs = outputs(batches[index].to(parts.device))
        losses.append(loss)
        eos.append(batches[index].is_eos.to(loss.device))
        for (dev, st), (p, h_sumsq, y) in zip(stats.items(), outs, strict=True):
            st.add_inputs(p)
            st.add_targets(p, h_sumsq, y, sigma[dev], normalize=step_scale == "rms")
    ce = TokenCE()
    if losses:
        ce.add(torch.cat(losses), torch.cat(eos))
    # data-parallel: the statistics of all blocks in one sum over the ranks, the CE sums in another
    distributed.all_reduce_sum(*[t for st in stats.values() for t in (st.gram, st.cross)])
    ce = reduce_ce(ce)
    for st in stats.values():
        st.positions = ce.tokens  # every block saw every predict position
    out = {}
    for dev, ls in by_device.items():
        for i, l in enumerate(ls):
            out[l] = stats[dev][i]
    return out, ce


def solve_blocks(
    adapters: ResidualAdapters,
    credit: Credit,
    stats: dict[int, BlockStats],
    blocks: Sequence[int],
    eta: float,
    lam_rel: float,
    center: str,
    budget_mb: float = 64.0,
) -> None:
    """Replace ``B_l`` of every block in ``blocks`` by its ridge solve, in place: batched solves
    (:func:`loca.core.ridge.solve_block` on a stack) per device, over as many blocks at a time as keep
    the solve's float64 d×r temporaries (about six per block) within ``budget_mb``."""
    d, r = adapters.parts.hidden_size, adapters.rank
    step = max(1, int(budget_mb * 2**20 // (6 * d * r * 8)))
    for on_device in _by_device(adapters, blocks).values():
        for i in range(0, len(on_device), step):
            ls = on_device[i : i + step]
            gram, cross = (stacked.stack([getattr(stats[l], f) for l in ls]) for f in ("gram", "cross"))
            b = stacked.stack([adapters.B[l] for l in ls])
            us = stacked.stack([credit.lift(l) for l in ls])
            new = solve_block(b, BlockStats(gram, cross), us, eta, lam_rel, center)
            stacked.assign([adapters.B[l] for l in ls], new)


def stage2_pass(
    parts: ModelParts,
    adapters: ResidualAdapters,
    credit: Credit,
    train: Sequence[Batch],
    b: list[torch.Tensor],
    eta: float,
    lam_rel: float,
    cfg: LocaConfig,
    groups: list[list[int]] | None = None,
    first: tuple[dict[int, BlockStats], TokenCE] | None = None,
    graphs: BatchGraphs | None = None,
) -> tuple[float, tuple[dict[int, BlockStats], TokenCE]]:
    """One Stage II step: from adapters ``b``, one Gauss–Seidel sweep over ``groups`` (default
    ``block_groups(L, cfg.groups)``): a forward pass per group collecting its blocks' statistics,
    then each block's ridge solve with step ``eta``. Leaves the adapters at the new B and returns
    ``(training CE at b, the first group's statistics)``; pass those back as ``first`` to retry
    from the same ``b`` with another η without a new forward pass. ``graphs``: CUDA graphs made
    for ``train`` (:class:`loca.method.graphs.BatchGraphs`). This is the step
    :func:`loca.method.fit.fit` takes and ``loca bench`` times."""
    groups = groups or block_groups(parts.num_blocks, cfg.groups)
    adapters.set_b(b)
    train_ce = math.nan
    for gi, blocks in enumerate(groups):
        if gi == 0 and first is not None:
            stats, ce = first
        else:
            stats, ce = collect_statistics(parts, adapters, credit, train, blocks, cfg.step_scale, graphs)
            if gi == 0:
                first = (stats, ce)
        if gi == 0:
            train_ce = ce.mean
        solve_blocks(adapters, credit, stats, blocks, eta, lam_rel, cfg.ridge_center)
    return train_ce, first

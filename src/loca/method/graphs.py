"""CUDA graphs for Stage II: each batch's pass is captured once and replayed after.

Every Stage II iteration runs the same training and held-out batches through the same kernels;
only B (and, after a re-calibration, the maps) change. On a GPU a short batch's eager pass is
bound by the CPU issuing kernels (dozens per block), not by arithmetic, so the launches are worth
paying once: a batch's forward with the adapters and the recording hooks, its head error and
adapter codes (training) or its losses (held-out) are captured as one graph on the batch's first
pass and replayed on every later one. The graphs read A, B and the maps' V from fixed buffers:
B is copied in whenever it changed (:meth:`BatchGraphs.run` checks), A and V by
:meth:`BatchGraphs.fixed` before each training pass.

Short batches are padded on the right to a multiple of :data:`BUCKET` tokens (masked), so that a
fit meets few distinct shapes. Each graph's outputs are consumed before the next graph runs, so all
graphs share one memory pool: the captured memory is one batch's activations plus each batch's
outputs (L·N·(r + k) floats for a training batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from ..data.batching import Batch
from ..models.parts import ModelParts
from .adapters import ResidualAdapters


class StaticWeights:
    """Fixed buffers of every block's Aᵀ and Bᵀ in the hidden dtype, which the hooks read while
    :meth:`loca.method.adapters.ResidualAdapters.weights_from` is active: a captured graph replays
    the addresses it saw, so B must change in place there."""

    def __init__(self, adapters: ResidualAdapters):
        self.adapters = adapters
        self.buffers: list[tuple[Tensor, Tensor]] = []  # per block: Aᵀ, Bᵀ
        self.seen: list[tuple[Tensor, int]] = []  # per block: the B (and its version) copied in last

    def refresh(self, dtype: torch.dtype) -> None:
        """Copy the adapters' current B in (the buffers are made on the first call). Blocks whose
        B is unchanged since the last call (same tensor, same version) are not copied."""
        a_s, b_s = self.adapters.A, self.adapters.B
        if not self.buffers or self.buffers[0][0].dtype != dtype:
            self.buffers = [
                (a.T.to(dtype).contiguous(), b.T.to(dtype).contiguous())
                for a, b in zip(a_s, b_s, strict=True)
            ]
        else:
            for (_, bt), b, seen in zip(self.buffers, b_s, self.seen, strict=True):
                if seen[0] is not b or seen[1] != b._version:  # B replaced or edited since
                    bt.copy_(b.T)
        self.seen = [(b, b._version) for b in b_s]

    def __call__(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.buffers[layer]


class BatchGraphs:
    """Captured per-batch passes over one fixed list of batches (on one CUDA device)."""

    def __init__(self, parts: ModelParts, adapters: ResidualAdapters, batches: Sequence[Batch], pool=None):
        """``pool``: another :class:`BatchGraphs`' ``pool`` to share (their replays never overlap)."""
        self.parts, self.adapters = parts, adapters
        self.weights = StaticWeights(adapters)
        self.batches = [_prepared(b, parts).to(parts.device) for b in batches]  # the graphs' fixed inputs
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(parts.device)  # capture needs a side stream
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._fixed: dict[Hashable, tuple[Tensor, ...]] = {}
        self._warm = False
        self.capture_s = 0.0

    @staticmethod
    def supported(parts: ModelParts) -> bool:
        """A CUDA model on one device (a model spread over devices runs eagerly)."""
        devices = {parts.device, *parts.block_devices()}
        return parts.device.type == "cuda" and len(devices) == 1

    def fixed(self, key: Hashable, *tensors: Tensor) -> tuple[Tensor, ...]:
        """Fixed buffers under ``key`` holding ``tensors``' current values (copies made on the
        first call, refilled in place after), for a graph to read: call before each pass whose
        graphs read them (the maps may have been refitted)."""
        if key not in self._fixed:
            self._fixed[key] = tuple(t.clone() for t in tensors)
        else:
            for buffer, t in zip(self._fixed[key], tensors, strict=True):
                buffer.copy_(t)
        return self._fixed[key]

    def run(self, index: int, fn: Callable[[Batch], tuple], key: Hashable = ()) -> tuple:
        """``fn(batch)`` for batch ``index`` through its graph (one per ``(index, key)``):
        captured on the first call, replayed after, with the adapters' current B. The returned
        tensors are the graph's own: they hold this replay's values until it runs again."""
        self.weights.refresh(self.parts.hidden_dtype)  # no-op unless B changed
        if (index, key) not in self._graphs:
            self._capture(index, fn, key)
        graph, out = self._graphs[(index, key)]
        graph.replay()
        return out

    def _capture(self, index: int, fn: Callable[[Batch], tuple], key: Hashable) -> None:
        t0 = time.perf_counter()
        batch, device = self.batches[index], self.parts.device
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream), self.adapters.weights_from(self.weights):
            if not self._warm:  # lazy initialisations (cuBLAS handles, workspaces) precede capture
                fn(batch)
                self._warm = True
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            try:
                out = fn(batch)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(self.stream)
        self._graphs[(index, key)] = (graph, out)
        self.capture_s += time.perf_counter() - t0


BUCKET = 32  # short batches are padded to a multiple of this: few distinct shapes to capture
BUCKET_BELOW = 256  # longer batches are left as they are: padding them would cost arithmetic


def _prepared(batch: Batch, parts: ModelParts) -> Batch:
    """``batch`` as its graph takes it. Shorter than :data:`BUCKET_BELOW` tokens, it is padded on
    the right (masked) to a multiple of :data:`BUCKET` tokens: every new matmul shape costs a
    one-off library heuristic (paid again by the capture of an unseen shape; docs/benchmarks.md),
    and padding on the right leaves the real positions' values unchanged up to rounding (masked
    keys get zero attention weight). A batch with no padding gets no mask (None), so that its
    attention takes the causal kernel, as the eager forward finds by itself."""
    t = batch.input_ids.shape[1]
    width = -(-t // BUCKET) * BUCKET if t < BUCKET_BELOW else t
    if width > (getattr(parts.model.config, "max_position_embeddings", None) or width):
        width = t
    pad = lambda x: torch.nn.functional.pad(x, (0, width - t))  # noqa: E731
    mask = pad(batch.attention_mask)
    return Batch(
        pad(batch.input_ids),
        None if bool(mask.all()) else mask,
        batch.pos_b,
        batch.pos_t,
        batch.targets,
        batch.is_eos,
        batch.items,
    )


def batch_graphs(
    parts: ModelParts, adapters: ResidualAdapters, batches: Sequence[Batch], share: BatchGraphs | None = None
) -> BatchGraphs | None:
    """Graphs for ``batches`` (sharing ``share``'s memory pool, if given), or None where graphs do
    not apply (not one CUDA device)."""
    if not BatchGraphs.supported(parts):
        return None
    return BatchGraphs(parts, adapters, batches, pool=share.pool if share is not None else None)

"""The data-dependent initialisation of the adapters' fixed down-projections A (``a_init =
'principal'``); the default, random A, is :func:`loca.method.adapters.adapter_a`."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.ridge import nystrom_top_eigenvectors
from ..infra import distributed
from ..models.parts import ModelParts, at_positions
from .adapters import adapter_a


@torch.inference_mode()
def principal_a(parts: ModelParts, batches, rank: int, seed: int = 0, oversample: int = 10) -> list[Tensor]:
    """A data-dependent A_l (r×d, orthonormal rows): the top-r principal directions (uncentred) of
    block l's input at the predict positions, from one forward pass over ``batches``.

    Each block streams only the sketch ``Σ Hᵀ(HΩ)`` (d×m, m = r + ``oversample``) with a seeded
    Gaussian Ω; :func:`loca.core.ridge.nystrom_top_eigenvectors` turns it into the eigenvectors, so no
    d×d matrix and no hidden state outlives its batch. Deterministic for a fixed seed on CPU."""
    d = parts.hidden_size
    m = min(d, rank + oversample)
    devices = parts.block_devices()
    omegas = [adapter_a(seed + 7919, l, m, d).T.double().to(dev) for l, dev in enumerate(devices)]
    sketches = [torch.zeros(d, m, dtype=torch.float64, device=dev) for dev in devices]
    where: dict[str, Tensor] = {}

    def hook(layer: int):
        def accumulate(module, args, kwargs, output):
            h_in = args[0] if args else kwargs["hidden_states"]
            rows = at_positions(h_in.to(sketches[layer].device), where["b"], where["t"]).double()
            sketches[layer].add_(rows.T @ (rows @ omegas[layer]))

        return accumulate

    handles = [blk.register_forward_hook(hook(l), with_kwargs=True) for l, blk in enumerate(parts.blocks)]
    try:
        for batch in distributed.shard(batches):
            b = batch.to(parts.device)
            where["b"], where["t"] = b.pos_b, b.pos_t
            parts.final_hidden(b.input_ids, b.attention_mask, b.pos_b, b.pos_t)
    finally:
        for h in handles:
            h.remove()
    distributed.all_reduce_sum(*sketches)  # data-parallel: the sketches are sums
    pairs = zip(sketches, omegas, strict=True)
    return [nystrom_top_eigenvectors(s, o, rank).T.float().cpu() for s, o in pairs]

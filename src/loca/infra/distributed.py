"""Data parallelism over ``torch.distributed`` (NCCL on GPUs, Gloo on CPUs), launched by
``torchrun``. Every rank holds the whole model and the same data; each runs its share of the
batches (:func:`shard`), and what LoCA keeps are sums, reduced once per pass in float64: the
Stage II statistics (r² + k·r numbers per block), CE sums and token counts, the principal-A
sketches. Calibration gathers the probe's errors and gradients in the single-process order, so
the maps are those of one process. Only rank 0 writes files and shows progress.

A rank may hold no batch of a pass (fewer batches than ranks): it still takes part in every
collective, with zero sums. Ranks exchange a hash of their data at the start of a run
(:func:`check_same`), and :func:`describe` says how a run was launched, for its ``config.json``.

Without an initialised process group every function is the identity (one process)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

_MEMBERS: list[dict] = []  # every rank's host and device, gathered when init_from_env joins


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def shard(items: Sequence[T]) -> list[T]:
    """This rank's share: every ``world_size``-th item from its rank on (all of them alone)."""
    return list(items[rank() :: world_size()]) if active() else list(items)


def owned(n: int) -> list[int]:
    """The indices of ``n`` items that :func:`shard` gives this rank."""
    return list(range(rank(), n, world_size())) if active() else list(range(n))


FLAT_BYTES = 16 * 2**20  # tensors summed through one flat buffer up to this size in all


def all_reduce_sum(*tensors: torch.Tensor) -> None:
    """Sum each tensor over the ranks, in place (float64 stays). Small tensors of one device and
    dtype go through one flat buffer (one collective for, e.g., all blocks' statistics)."""
    if not active():
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        small = t.numel() * t.element_size() <= FLAT_BYTES
        groups.setdefault((t.device, t.dtype) if small else ("alone", id(t)), []).append(t)
    for group in groups.values():
        total = sum(t.numel() * t.element_size() for t in group)
        if len(group) == 1 or total > FLAT_BYTES:
            for t in group:
                _all_reduce(t)
            continue
        flat = torch.cat([t.reshape(-1) for t in group])
        _all_reduce(flat)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _all_reduce(t: torch.Tensor) -> None:
    if dist.get_backend() == "nccl" and t.device.type != "cuda":
        moved = t.cuda()
        dist.all_reduce(moved)
        t.copy_(moved)
    else:
        dist.all_reduce(t)


def all_reduce_numbers(values: list[float]) -> list[float]:
    """Sum a few Python numbers over the ranks (float64)."""
    if not active():
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def from_main(value: float) -> float:
    """Rank 0's ``value`` on every rank: a decision that depends on a clock (a time budget) is
    taken once, so that every rank runs the same number of collectives."""
    if not active():
        return value
    return all_reduce_numbers([value if is_main() else 0.0])[0]


def gather_objects(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order (pickled; for per-item results and probe rows)."""
    if not active():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if active():
        dist.barrier()


def broadcast_from_main(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (pickled), e.g. an error only rank 0 could see."""
    if not active():
        return obj
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_same(what: str, value: str) -> None:
    """Raise the same ``ValueError`` on every rank when the ranks hold different ``value``s (a
    hash of what each rank read): data parallelism needs every rank to see the same data, and a
    rank that differs would otherwise only show at evaluation, or never."""
    if not active():
        return
    values = gather_objects(value)
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        raise ValueError(
            f"the ranks see different {what}: rank(s) {', '.join(map(str, differ))} differ from rank 0 "
            f"(hash {str(values[differ[0]])[:12]} vs {str(values[0])[:12]}); every rank must read the "
            "same data files and settings (check --data-dir, --task and the files on every machine)"
        )


def describe(device: str) -> dict:
    """How this run was launched, for its ``config.json``: the number of processes, the
    ``torch.distributed`` backend (None for one process) and every rank's device (``device``:
    this process's, used when there is one process) and how many hosts they ran on."""
    if not active():
        return {"world_size": 1, "backend": None, "devices": [device], "hosts": 1}
    members = _MEMBERS if len(_MEMBERS) == world_size() else []
    return {
        "world_size": world_size(),
        "backend": str(dist.get_backend()),
        "devices": [m["device"] for m in members] or None,  # None: the group was not joined here
        "hosts": len({m["host"] for m in members}) or None,
    }


def init_from_env(device: str = "auto") -> str:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE`` > 1 in the environment) and
    return the device this rank uses: ``cuda:LOCAL_RANK`` with NCCL when CUDA is there and
    ``device`` allows it, else the CPU with Gloo. Without torchrun: ``device`` unchanged."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=30))
    mine = f"cuda:{local}" if use_cuda else ("cpu" if device == "auto" else device)
    _MEMBERS[:] = gather_objects({"host": socket.gethostname(), "device": mine})
    return mine


def local_device(device: str) -> str:
    """The device a rank uses: its own GPU under NCCL (``cuda:LOCAL_RANK``), else ``device``."""
    if active() and dist.get_backend() == "nccl" and device in ("auto", "cuda"):
        return f"cuda:{torch.cuda.current_device()}"
    if active() and device == "auto":
        return "cpu"
    return device


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

"""Resource measurement: wall time and peak memory beyond the loaded model, per phase.

GPU: ``torch.cuda.max_memory_allocated`` after a reset, minus the allocation before the phase.
CPU: process RSS sampled by a background thread during the phase (peak and median), minus the
RSS before it. Phases are repeated and interleaved on the same batches, so ratios between phases
of one run are meaningful even on a noisy machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import psutil
import torch

from ..infra.memory import LIBC, M_MMAP_THRESHOLD, RssSampler, trim


@dataclass
class PhaseResult:
    phase: str
    time_s: float  # median over repeats
    time_s_min: float
    peak_mb: float  # peak memory beyond the loaded model (max over repeats)
    median_mb: float  # CPU: median RSS beyond the baseline during the phase; GPU: = peak
    repeats: int
    device: str

    def to_dict(self) -> dict:
        return asdict(self)


def measure_once(
    fn: Callable[[], object], device: torch.device, sample_rss: bool = True
) -> tuple[float, float, float]:
    """Run ``fn`` once; return (seconds, peak MB beyond baseline, median MB beyond baseline).

    On the CPU with ``sample_rss=False`` no sampling thread runs and both MB figures are NaN.
    """
    trim()
    mb = 2.0**20
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated(device) - base) / mb
        return dt, peak, peak
    if not sample_rss:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, float("nan"), float("nan")
    base = psutil.Process().memory_info().rss
    with RssSampler() as sampler:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
    extra = [max(0, s - base) / mb for s in sampler.samples]
    return dt, max(extra), statistics.median(extra)


def measure_phases(
    phases: dict[str, Callable[[], object]], device: torch.device, repeats: int = 3, warmup: int = 1
) -> list[PhaseResult]:
    """Time every phase ``repeats`` times, interleaved (round-robin), after ``warmup`` runs each.

    On the CPU, memory is measured in one more interleaved sweep with glibc returning every freed
    buffer to the OS (see :mod:`loca.infra.memory`), and time in sweeps with glibc's
    usual caching of large buffers and no sampling thread, so neither distorts the timings.
    """
    for fn in phases.values():
        for _ in range(warmup):
            fn()
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in phases}
    memory: dict[str, list[tuple[float, float]]] = {name: [] for name in phases}
    exact = device.type == "cpu" and LIBC is not None
    if exact:
        LIBC.mallopt(M_MMAP_THRESHOLD, 64 * 2**10)
        for name, fn in phases.items():
            memory[name].append(measure_once(fn, device)[1:])
        LIBC.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
    for _ in range(repeats):
        for name, fn in phases.items():
            runs[name].append(measure_once(fn, device, sample_rss=not exact))
            if not exact:
                memory[name].append(runs[name][-1][1:])
    return [
        PhaseResult(
            phase=name,
            time_s=statistics.median(r[0] for r in rs),
            time_s_min=min(r[0] for r in rs),
            peak_mb=max(m[0] for m in memory[name]),
            median_mb=statistics.median(m[1] for m in memory[name]),
            repeats=repeats,
            device=str(device),
        )
        for name, rs in runs.items()
    ]

"""Memory measurement shared by the library and the benchmarks: a process-RSS sampler and the peak
memory of a ``with`` body (GPU: allocated bytes; CPU: sampled RSS)."""

from __future__ import annotations

import ctypes
import gc
import threading

import psutil
import torch


def _libc():
    try:
        lib = ctypes.CDLL("libc.so.6")
        return lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else None
    except OSError:
        return None


LIBC = _libc()
M_MMAP_THRESHOLD = -3


def trim() -> None:
    gc.collect()
    if LIBC:
        LIBC.malloc_trim(0)


# glibc raises its mmap threshold after large frees and then keeps freed buffers in the heap, so
# a phase run after another shows no RSS growth at all. With a fixed 64 KiB threshold every tensor
# buffer is mapped on its own and unmapped when freed, and RSS tracks live memory.


class RssSampler:
    """Samples this process's resident set size every ``interval`` seconds in a thread."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.samples: list[int] = []
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._proc.memory_info().rss)


class PeakMemory:
    """Peak memory beyond what was in use on entry, over a ``with`` body, in MB (``peak_mb``).

    GPU: ``max_memory_allocated`` after a reset, minus the allocation on entry. CPU: the process's
    RSS sampled every 20 ms by a thread, minus the RSS on entry. ``kind`` names which was measured.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda_allocated" if device.type == "cuda" else "cpu_rss"
        self.peak_mb = float("nan")

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            trim()
            self._base = psutil.Process().memory_info().rss
            self._sampler = RssSampler(interval=0.02).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._sampler.__exit__(*exc)
            peak = max(self._sampler.samples)
        self.peak_mb = max(0, peak - self._base) / 2.0**20

"""Peak memory of a benchmark request: max allocated on CUDA, sampled RSS on CPU."""
from __future__ import annotations

import os
import threading

import torch


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class PeakMemory:
    """Peak memory during a ``with`` block: max allocated on CUDA, sampled RSS on CPU."""

    def __init__(self, device: torch.device, interval_s: float = 0.01):
        self.device, self.interval = torch.device(device), interval_s
        self.peak = 0
        self.kind = "cuda_max_allocated" if self.device.type == "cuda" else "rss"
        self._stop = threading.Event()
        self._thread = None

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss_bytes())

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = _rss_bytes()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())

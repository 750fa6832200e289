"""How long the copies of stored blocks into a page pool took (PagePool.write): what a load from host RAM costs
on this machine (serving/backends/transformers/load_costs.py).

On a CPU a copy's time is the thread's. On a GPU the copy is non_blocking, so the thread's time would be its
launch alone: it is timed by the device, between CUDA events recorded on the pool device's stream around the
copy, and counted once the later event has run (in order; each new copy settles those before it, so the queue
stays short without a reader). Not thread-safe: the pool calls it under its lock.
"""

from __future__ import annotations

import time
from collections import deque

import torch


class CopyTimes:
    def __init__(self, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        self.device = device
        self.bytes = 0  # of the copies whose time is known
        self.seconds = 0.0
        self._timing: deque = deque()  # (begin, end, bytes): CUDA copies whose time is not read yet

    def begin(self):
        """Before a copy: a CUDA event on the pool device's stream, or the thread's clock."""
        if not self.on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def end(self, begun, nbytes: int):
        """After the copy, outside the lock: what `add` takes."""
        if not self.on_gpu:
            return time.perf_counter() - begun, nbytes
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return (begun, event), nbytes

    def add(self, ended) -> None:
        """Under the pool's lock: a CPU copy's time at once, a GPU copy's once it has run."""
        took, nbytes = ended
        if self.on_gpu:
            self._timing.append((*took, nbytes))
            self.settle()
        else:
            self.bytes += nbytes
            self.seconds += took

    def settle(self) -> None:
        """The CUDA copies that have run, in order, their time read from their events."""
        while self._timing and self._timing[0][1].query():
            begin, end, nbytes = self._timing.popleft()
            self.bytes += nbytes
            self.seconds += begin.elapsed_time(end) / 1e3  # milliseconds

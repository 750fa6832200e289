"""Shared benchmark plumbing: environment record, timers that synchronize CUDA, medians, tables, output.

Benchmarks print a table, write one JSON file (and a PNG where matplotlib is present) and make the last
line of stdout one JSON document.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")


def git_sha() -> str | None:
    """The checkout's short sha; $KVMEM_GIT_SHA where the tree was copied without its .git (a lent GPU
    machine gets the working tree only: benchmarks/gpu/gpu_suite.sh passes the sha it was started from)."""
    if os.environ.get("KVMEM_GIT_SHA"):
        return os.environ["KVMEM_GIT_SHA"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None
    except OSError:
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def env_info(device: str = "cpu") -> dict:
    import torch
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_sha": git_sha(),
        "device": device,
        "cpu": cpu_name(),
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # 1/5/15-minute load averages when the record is made: the machine is shared, and another job's
        # load slows every arm
        "loadavg": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all cores since boot, from /proc/stat (steal counts as busy: another VM
    had the core); None where there is no /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in first[1:9])
    total = user + nice + system + idle + iowait + irq + softirq + steal
    return total - idle - iowait, total


def own_cpu_s() -> float:
    """CPU seconds this process has used, all its threads."""
    t = os.times()
    return t.user + t.system


class OthersCpu:
    """The share of all cores' time that other processes used over a window: the machine's busy ticks minus
    this process's own CPU time. The machine is shared; a share well above 0 means the timings are slowed by
    another job. `share()` is None where /proc/stat is missing or the window was shorter than one clock tick.
    Readers are injected for tests."""

    def __init__(
        self,
        read_ticks: Callable[[], tuple[int, int] | None] = cpu_ticks,
        read_own_s: Callable[[], float] = own_cpu_s,
        ticks_per_s: int | None = None,
    ) -> None:
        self._read_ticks = read_ticks
        self._read_own_s = read_own_s
        self._hz = ticks_per_s or os.sysconf("SC_CLK_TCK")
        self._start: tuple[tuple[int, int] | None, float] | None = None

    def start(self) -> None:
        self._start = (self._read_ticks(), self._read_own_s())

    def share(self) -> float | None:
        """Others' share of the cores since `start()`, in [0, 1]."""
        assert self._start is not None, "start() first"
        ticks0, own0 = self._start
        ticks1, own1 = self._read_ticks(), self._read_own_s()
        if ticks0 is None or ticks1 is None or ticks1[1] <= ticks0[1]:
            return None
        others = (ticks1[0] - ticks0[0]) - (own1 - own0) * self._hz
        return min(1.0, max(0.0, others / (ticks1[1] - ticks0[1])))


def wait_for_quiet(
    max_share: float, max_wait_s: float, window_s: float = 2.0, meter: OthersCpu | None = None
) -> float:
    """Sleep until other processes used less than `max_share` of the cores over two windows in a row, or
    `max_wait_s` passed; returns the seconds waited."""
    meter = meter or OthersCpu()
    start, quiet = time.perf_counter(), 0
    while time.perf_counter() - start < max_wait_s:
        meter.start()
        time.sleep(window_s)
        share = meter.share()
        quiet = quiet + 1 if share is None or share < max_share else 0
        if quiet >= 2:
            break
    return time.perf_counter() - start


class QuietRun(NamedTuple, Generic[T]):
    result: T
    others_share: float | None  # other processes' share of the cores during the kept attempt
    attempts: int
    waited_s: float  # waiting for a quiet machine, all attempts


def run_when_quiet(
    fn: Callable[[], T],
    *,
    max_share: float | None,
    attempts: int,
    max_wait_s: float,
    meter: OthersCpu | None = None,
    wait: Callable[[float, float], float] = wait_for_quiet,
) -> QuietRun[T]:
    """Run `fn` while measuring other processes' share of the cores. With `max_share`, first wait for a quiet
    machine, and run again (up to `attempts` runs in all) while others took more than `max_share`; the last
    run is kept either way, and its share says how clean it was."""
    assert attempts >= 1, attempts
    meter = meter or OthersCpu()
    waited, runs = 0.0, 0
    while True:
        runs += 1
        if max_share is not None:
            waited += wait(max_share, max_wait_s)
        meter.start()
        result = fn()
        share = meter.share()
        if max_share is None or share is None or share <= max_share or runs == attempts:
            return QuietRun(result, share, runs, waited)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(device))


def timed(fn: Callable[[], object], device: str) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def p90(xs: Sequence[float]) -> float:
    ordered = sorted(xs)
    return float(ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for k, row in enumerate(cells):
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def write_outputs(result: dict, out: str | None) -> None:
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    print(json.dumps(result))

"""The step-timing probe's kernel window: what the device runs during one-stream decode steps, kernel by kernel.

``HIGGS_STEP_TIMING_KERNELS=SKIP,STEPS`` (e.g. ``300,50``): after SKIP (at least 1) one-stream decode steps
(``decode b=1`` or ``replayed b=1``: warm-up, graph capture and the first requests left out) the probe starts
``torch.profiler`` at the boundary between two steps, stops it once STEPS more such steps have closed, and writes
``kernels_<pid>.txt``: the window's steps (and any others that fell in it: a prefill, a larger batch), then every
kernel the device ran in it with its launches and device time per one-stream step, longest first, and their sum.
Kernels replayed from CUDA graphs are included (CUPTI traces them). Other processes' kernels (vllm-omni's Stage 1
on the same GPU) are not: the sum is this process's busy time, the step interval minus it the time the device was
idle or busy for others. Off by default (nothing profiled; ``torch.profiler`` is imported only when asked).
"""

from __future__ import annotations

import os
import time


def parse(spec: str | None) -> tuple[int, int] | None:
    """``"SKIP,STEPS"`` -> (skip, steps); None when unset or empty; ValueError naming the value otherwise."""
    if not spec:
        return None
    try:
        skip, steps = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"HIGGS_STEP_TIMING_KERNELS must be SKIP,STEPS (two integers), got {spec!r}") from None
    if skip < 0 or steps < 1:
        raise ValueError(f"HIGGS_STEP_TIMING_KERNELS needs SKIP >= 0 and STEPS >= 1, got {spec!r}")
    return skip, steps


class KernelWindow:
    """Counts the one-stream decode steps a recorder closes; profiles STEPS of them after SKIP."""

    def __init__(self, skip: int, steps: int, out_dir: str, cuda: bool) -> None:
        self.skip, self.steps, self.cuda = skip, steps, cuda
        self.path = os.path.join(out_dir, f"kernels_{os.getpid()}.txt")
        self.seen = 0  # one-stream decode steps closed so far
        self.inside: dict[str, int] = {}  # categories of the steps closed inside the window
        self.profiler = None
        self.started = 0.0
        self.done = False

    def step_closed(self, category: str) -> None:
        """A step of ``category`` was filed; the next one opens right after (a window starts and ends there)."""
        if self.done:
            return
        single = category in ("decode b=1", "replayed b=1")
        if self.profiler is not None:
            self.inside[category] = self.inside.get(category, 0) + 1
        self.seen += single
        start = max(self.skip, 1)  # a window opens after a one-stream step closed
        if self.profiler is None and single and self.seen == start:
            self._start()
        elif self.profiler is not None and self.seen == start + self.steps:
            self._stop()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
        self.profiler = profile(activities=activities)
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def _stop(self) -> None:
        wall = time.perf_counter() - self.started
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        self.done = True
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(self.report(self.profiler.key_averages(), wall))

    def report(self, averages, wall: float) -> str:
        """The window's table: per kernel (CPU ops where there is no CUDA), launches and device us per step."""
        n = self.steps
        rows = []
        for evt in averages:
            kind = str(getattr(evt, "device_type", "")).rsplit(".", 1)[-1]
            if self.cuda and kind != "CUDA":
                continue  # host-side ops: their kernels are rows of their own
            us = getattr(evt, "self_device_time_total", 0.0) if self.cuda else evt.self_cpu_time_total
            rows.append((us, evt.count, evt.key))
        rows.sort(reverse=True)
        total = sum(us for us, _, _ in rows)
        what = "device (this process's kernels)" if self.cuda else "CPU (no CUDA: host ops)"
        lines = [f"kernel window: {n} one-stream decode steps after {self.skip}; steps closed in it: {self.inside}",
                 f"wall {wall * 1e6 / n:.0f} us a step; {what} {total / n:.0f} us a step", "",
                 f"{'us/step':>9} {'share':>6} {'calls/step':>10}  name"]  # fmt: skip
        for us, count, key in rows:
            lines.append(f"{us / n:9.1f} {us / max(total, 1e-9):6.1%} {count / n:10.2f}  {key[:160]}")
        return "\n".join(lines) + "\n"

"""The step-timing probe's windows: what the device runs (kernels) and where the worker's thread spends its time
(host) during decode steps of one batch size, step by step.

``HIGGS_STEP_TIMING_KERNELS=SKIP,STEPS[,BATCH]`` (e.g. ``300,50`` or ``20,30,64``): after SKIP (at least 1) decode
steps whose batch falls in BATCH's category (default 1: ``decode b=1`` or ``replayed b=1``; 64: ``b=64-``; warm-up,
graph capture and the first requests left out) the probe starts ``torch.profiler`` at the boundary between two steps,
stops it once STEPS more such steps have closed, and writes ``kernels_<pid>.txt``: the window's steps (and any others
that fell in it: a prefill, another batch size), then every kernel the device ran in it with its launches and device
time per step of the window's kind, longest first, and their sum. Kernels replayed from CUDA graphs are included
(CUPTI traces them). Other processes' kernels (vllm-omni's Stage 1 on the same GPU) are not: the sum is this
process's busy time, the step interval minus it the time the device was idle or busy for others.

``HIGGS_STEP_TIMING_HOST=SKIP,STEPS[,BATCH]`` opens the same kind of window with ``cProfile`` on the thread that runs
the entry points (in vllm-omni's and vLLM's engine process: the scheduler, the runner's input preparation, our
calls, the output processing of that thread; other threads are not seen) and writes ``host_<pid>.txt``: the
functions by own time and by cumulative time, in milliseconds per step. cProfile slows Python down (about 1.5-2x):
read shares, not absolute times.

``HIGGS_STEP_TIMING_PREFILL=SKIP,COUNT[,BATCH]`` profiles whole prefill steps instead: after SKIP prefill steps whose
batch falls in BATCH's category (default 1), each of the next COUNT is profiled with ``torch.profiler`` (host ops and,
on CUDA, kernels) from the entry point that shows it is a prefill (vllm-omni's ``prepare_runner_inputs`` gives each
request's token count) to the step's close, and written as ``prefill_<pid>_<n>.json`` (a Chrome trace: host and
device timelines side by side) and ``prefill_<pid>_<n>.txt`` (the step's wall time, then ops and kernels by their own
time).

One profiler runs at a time in a process: a window or trace that comes due while another's profiler is open waits
(a window for its next step of its kind, a trace for its next prefill). A tool that raises is closed and writes
what failed to its file; the process it probes goes on (the probe must never take a worker down).

Off by default (nothing profiled; ``torch.profiler`` and ``cProfile`` are imported only when asked).
"""

from __future__ import annotations

import contextlib
import os
import time

from higgs_step_record import batch_label

_holder = None  # the window or trace whose profiler is open in this process (one at a time)


def claim(tool: object) -> bool:
    """Whether ``tool`` may open its profiler now (none other is open); it then holds the process's one slot."""
    global _holder
    if _holder is None or _holder is tool:
        _holder = tool
        return True
    return False


def release(tool: object) -> None:
    """Give the slot back if ``tool`` holds it (its profiler closed, or it failed)."""
    global _holder
    if _holder is tool:
        _holder = None


def parse(spec: str | None, name: str = "HIGGS_STEP_TIMING_KERNELS") -> tuple[int, int, int] | None:
    """``"SKIP,STEPS[,BATCH]"`` -> (skip, steps, batch), batch 1 unless given; None when unset or empty; ValueError
    naming the variable and the value otherwise."""
    if not spec:
        return None
    try:
        values = [int(x) for x in spec.split(",")]
    except ValueError:
        values = []
    if len(values) not in (2, 3):
        raise ValueError(f"{name} must be SKIP,STEPS or SKIP,STEPS,BATCH (integers), got {spec!r}")
    skip, steps, batch = (*values, 1)[:3]
    if skip < 0 or steps < 1 or batch < 1:
        raise ValueError(f"{name} needs SKIP >= 0, STEPS >= 1 and BATCH >= 1, got {spec!r}")
    return skip, steps, batch


class KernelWindow:
    """Counts the decode steps of one batch category a recorder closes; profiles STEPS of them after SKIP."""

    prefix, what = "kernels", "kernel window"

    def __init__(self, skip: int, steps: int, batch: int, out_dir: str, cuda: bool) -> None:
        self.skip, self.steps, self.cuda = skip, steps, cuda
        self.label = batch_label(batch)
        self.path = os.path.join(out_dir, f"{self.prefix}_{os.getpid()}.txt")
        self.seen = self.counted = self.opened_after = 0  # its kind's steps closed: all, inside, before it opened
        self.inside: dict[str, int] = {}  # categories of the steps closed inside the window
        self.profiler = None
        self.started = 0.0
        self.done = False

    def step_closed(self, category: str) -> None:
        """A step of ``category`` was filed; the next one opens right after (a window starts and ends there)."""
        if self.done:
            return
        kind, _, label = category.partition(" ")
        counted = kind in ("decode", "replayed") and label == self.label
        if self.profiler is not None:
            self.inside[category] = self.inside.get(category, 0) + 1
            self.counted += counted
            if self.counted == self.steps:
                self._stop()
            return
        self.seen += counted
        if counted and self.seen >= max(self.skip, 1) and claim(self):  # after a step of its kind closed
            self.opened_after = self.seen
            self._start()

    def paused(self):
        """A context in which the window does not count what runs (the probe's own summary writes); torch's
        profiler records kernels only, which those do not launch, so nothing to pause here."""
        return contextlib.nullcontext()

    def fail(self, exc: BaseException) -> None:
        """Close the window after ``exc`` (best effort) and write what failed in place of its table."""
        if self.profiler is not None:
            with contextlib.suppress(Exception):  # already failing: the first error is the one to report
                self._finish()
        self.profiler, self.done = None, True
        release(self)
        _write_failure(self.path, self.what, exc)

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
        self.profiler = profile(activities=activities)
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def _finish(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)

    def _stop(self) -> None:
        wall = time.perf_counter() - self.started
        self._finish()
        self.done = True
        release(self)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        head = (f"{self.what}: {self.steps} decode steps ({self.label}) after {self.opened_after}; steps closed in "
                f"it: {self.inside}\nwall {wall * 1e6 / self.steps:.0f} us a step")  # fmt: skip
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(head + self.report())

    def report(self) -> str:
        """The window's table: per kernel (CPU ops where there is no CUDA), launches and device us per step."""
        n = self.steps
        rows = []
        for evt in self.profiler.key_averages():
            kind = str(getattr(evt, "device_type", "")).rsplit(".", 1)[-1]
            if self.cuda and kind != "CUDA":
                continue  # host-side ops: their kernels are rows of their own
            us = getattr(evt, "self_device_time_total", 0.0) if self.cuda else evt.self_cpu_time_total
            rows.append((us, evt.count, evt.key))
        rows.sort(reverse=True)
        total = sum(us for us, _, _ in rows)
        what = "device (this process's kernels)" if self.cuda else "CPU (no CUDA: host ops)"
        lines = [f"; {what} {total / n:.0f} us a step", "", f"{'us/step':>9} {'share':>6} {'calls/step':>10}  name"]
        for us, count, key in rows:
            lines.append(f"{us / n:9.1f} {us / max(total, 1e-9):6.1%} {count / n:10.2f}  {key[:160]}")
        return "\n".join(lines) + "\n"


class HostWindow(KernelWindow):
    """The same window with ``cProfile`` on the calling thread: where its host time goes, function by function."""

    prefix, what, top = "host", "host window (cProfile, this thread)", 60

    def _start(self) -> None:
        import cProfile

        self.profiler = cProfile.Profile()
        self.started, self.cpu = time.perf_counter(), time.thread_time()
        self.profiler.enable()

    def _finish(self) -> None:
        self.profiler.disable()
        self.cpu = time.thread_time() - self.cpu  # this thread's CPU time: the wall minus it is waiting (GIL, GPU)

    @contextlib.contextmanager
    def paused(self):
        """cProfile off while the probe writes its summary (the probe's time, not the worker's)."""
        profiler = self.profiler
        if profiler is not None:
            profiler.disable()
        try:
            yield
        finally:
            if profiler is not None and self.profiler is profiler:
                profiler.enable()

    def report(self) -> str:
        """The ``top`` functions by own time, then by cumulative time: ms per step, share of the window's wall, calls
        per step."""
        import pstats

        n, stats = self.steps, pstats.Stats(self.profiler).stats  # (file, line, name) -> (cc, calls, tt, ct, callers)
        wall = sum(tt for _, _, tt, _, _ in stats.values())
        lines = [f"; this thread's CPU time {self.cpu * 1e3 / n:.2f} ms a step (the rest of the wall it waited: for "
                 f"the GIL, the GPU, a lock); profiled own time {wall * 1e3 / n:.2f} ms a step"]  # fmt: skip
        for title, index in (("own time", 2), ("cumulative time", 3)):
            lines += ["", f"by {title}:", f"{'ms/step':>9} {'share':>6} {'calls/step':>10}  function"]
            ranked = sorted(stats.items(), key=lambda kv: kv[1][index], reverse=True)[: self.top]
            for (path, line, func), values in ranked:
                where = f"{os.path.basename(path)}:{line}({func})" if line else func
                lines.append(f"{values[index] * 1e3 / n:9.3f} {values[index] / max(wall, 1e-12):6.1%} "
                             f"{values[1] / n:10.2f}  {where[:160]}")  # fmt: skip
        return "\n".join(lines) + "\n"


class PrefillTrace:
    """Profiles COUNT prefill steps of one batch category after SKIP of them, each on its own."""

    def __init__(self, skip: int, count: int, batch: int, out_dir: str, cuda: bool) -> None:
        self.skip, self.count, self.cuda, self.out_dir = skip, count, cuda, out_dir
        self.label = batch_label(batch)
        self.seen = self.traced = 0  # prefill steps of the category seen; traced so far
        self.last = self.step = self.profiler = None  # the step last counted; the one being traced, its profiler
        self.started = 0.0

    def step_known(self, step) -> None:
        """An entry point told how many tokens each request of ``step`` has (``step.longest``)."""
        if self.profiler is not None or self.traced >= self.count or step is self.last:
            return
        if step.batch < 1 or not step.longest or step.longest < 2 or batch_label(step.batch) != self.label:
            return  # not a prefill of the category (a dummy run names no request)
        self.last, self.seen = step, self.seen + 1
        if self.seen > self.skip and claim(self):  # else another profiler is open: the next prefill may be traced
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.step, self.profiler = step, profile(activities=activities)
            self.profiler.__enter__()
            self.started = time.perf_counter()

    def step_closed(self, step) -> None:
        """Where ``step`` is the one being traced: stop, and write its trace and tables."""
        if self.profiler is None or step is not self.step:
            return
        wall = time.perf_counter() - self.started
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        self.traced += 1
        base = os.path.join(self.out_dir, f"prefill_{os.getpid()}_{self.traced}")
        os.makedirs(self.out_dir, exist_ok=True)
        self.profiler.export_chrome_trace(base + ".json")
        averages = self.profiler.key_averages()
        with open(base + ".txt", "w", encoding="utf-8") as f:
            f.write(f"prefill step {self.seen} ({self.label}; batch {step.batch}, tokens {step.tokens}, longest "
                    f"{step.longest}): wall {wall * 1e3:.2f} ms from its token counts to its close\n\n")  # fmt: skip
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
            if self.cuda:
                f.write(averages.table(sort_by="self_device_time_total", row_limit=40) + "\n")
        self.step = self.profiler = None
        release(self)

    def fail(self, exc: BaseException) -> None:
        """Stop tracing after ``exc`` (best effort): no more prefill steps are traced; what failed is written."""
        profiler, self.step, self.profiler, self.traced = self.profiler, None, None, self.count
        release(self)
        if profiler is not None:
            with contextlib.suppress(Exception):  # already failing: the first error is the one to report
                profiler.__exit__(None, None, None)
        _write_failure(os.path.join(self.out_dir, f"prefill_{os.getpid()}_failed.txt"), "prefill trace", exc)


def _write_failure(path: str, what: str, exc: BaseException) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{what} failed: {type(exc).__name__}: {exc}\n")

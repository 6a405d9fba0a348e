"""The step-timing probe's record (``higgs_step_timing`` installs the probe): one process's steps, filed by
category, their CUDA events read when a summary is written, and the summary (``steps_<pid>.json``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch-size categories: 1, 2-3, 4-7, ..., 64-
Window = tuple[int, int, int]  # a profiling window's (skip, steps, batch): higgs_kernel_window.parse


@dataclass
class Step:
    start: float  # perf_counter at its first entry point
    rank: int = -1  # the last ranked entry point it saw
    batch: int = 0
    named: bool = False  # the batch came from request ids
    tokens: int | None = None
    longest: int | None = None  # most tokens of one request (vllm-omni's runner says)
    logits: bool = False
    forward: bool = False  # our forward ran in Python (not replayed inside a graph)
    probe: float = 0.0
    spent: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    events: dict[str, Any] = field(default_factory=dict)  # CUDA events: "start", "forward", "forward_end", "end"
    interval: float | None = None  # set when the next step opens
    forward_cuda: float | None = None  # us, set when the events are read
    step_cuda: float | None = None

    @property
    def kind(self) -> str:
        if not self.logits or self.batch == 0:
            return "other"
        if self.longest is not None:
            return "decode" if self.longest == 1 else "prefill"
        if self.tokens is not None:
            return "decode" if self.tokens == self.batch else "prefill"
        return "replayed"

    @property
    def category(self) -> str:
        kind = self.kind
        return kind if kind == "other" else f"{kind} {batch_label(self.batch)}"


def batch_label(batch: int) -> str:
    """The batch-size part of a category: ``b=1``, ``b=2-3``, ..., ``b=64-``."""
    low = max(b for b in BUCKETS if b <= batch)
    high = BUCKETS[BUCKETS.index(low) + 1] - 1 if low != BUCKETS[-1] else None
    return f"b={low}" if high == low else f"b={low}-{high or ''}"


def _safely(tool, call, arg) -> None:
    """``call(arg)``; an exception closes ``tool`` (its ``fail`` writes it down) instead of reaching the worker."""
    try:
        call(arg)
    except Exception as exc:  # noqa: BLE001 - a profiler that breaks must not take the probed process down
        tool.fail(exc)


class Recorder:
    """This process's steps: opens and closes them, records CUDA events, writes the summary."""

    def __init__(self, out_dir: str, every: int, flush_s: float, idle_s: float, classes: list[str],
                 kernels: Window | None = None, host: Window | None = None,
                 prefill: Window | None = None) -> None:  # fmt: skip
        self.pid, self.path = os.getpid(), os.path.join(out_dir, f"steps_{os.getpid()}.json")
        self.every, self.flush_s, self.idle_s, self.classes = every, flush_s, idle_s, classes
        self.depth, self.instances, self.idle_gaps = 0, 0, 0
        self.step: Step | None = None
        self.steps: dict[str, list[Step]] = {}  # category -> closed steps
        self.summaries: dict[str, dict] = {}  # category -> its summary, redone only for the categories in dirty
        self.dirty: set[str] = set()
        self.real_steps, self.since_flush, self.last_flush, self.final = 0, 0, time.perf_counter(), False
        torch = sys.modules.get("torch")  # CUDA only where the model already initialised it (never initialised here)
        self.cuda = torch if torch is not None and torch.cuda.is_initialized() else None
        self.pending: list[Step] = []  # closed steps whose CUDA events are not read yet
        self.free_events: list = []
        self.windows, self.traces = [], []  # the kernel and host windows, prefill traces (higgs_kernel_window)
        if kernels is not None or host is not None or prefill is not None:
            from higgs_kernel_window import HostWindow, KernelWindow, PrefillTrace

            for cls, spec, into in ((KernelWindow, kernels, self.windows), (HostWindow, host, self.windows),
                                    (PrefillTrace, prefill, self.traces)):  # fmt: skip
                if spec is not None:
                    into.append(cls(*spec, out_dir, self.cuda is not None))

    def enter(self, rank: int | None, now: float) -> Step:
        """The step an entry point at ``now`` belongs to: a new one if ``rank`` is not above the open step's (the
        summary is written here when due: its time is the new step's probe time)."""
        step = self.step
        if step is None or (rank is not None and rank <= step.rank):
            if step is not None and self.close(step, now):
                self.flush()
            step = self.step = Step(now)
            self.record(step, "start")
        if rank is not None:
            step.rank = rank
        return step

    def close(self, step: Step, now: float | None) -> bool:
        """File a finished step (``now``: when the next one opened; None at exit). Returns whether a summary is due."""
        interval = None if now is None else now - step.start
        if interval is not None and interval > self.idle_s:
            self.idle_gaps, interval = self.idle_gaps + 1, None
        step.interval = interval
        self.steps.setdefault(step.category, []).append(step)
        self.dirty.add(step.category)
        for window in self.windows if now is not None else ():
            _safely(window, window.step_closed, step.category)
        for trace in self.traces:
            _safely(trace, trace.step_closed, step)
        if "start" in step.events and "end" in step.events:
            self.pending.append(step)
        else:
            self.free_events.extend(step.events.values())
            step.events = {}
        if step.kind == "other":
            return False
        self.real_steps += 1
        self.since_flush += 1
        due = self.since_flush >= self.every and now is not None and now - self.last_flush >= self.flush_s
        return self.real_steps == 1 or due

    def observed(self, step: Step) -> None:
        """An entry point's arguments told more about ``step`` (its requests, their token counts)."""
        for trace in self.traces:
            _safely(trace, trace.step_known, step)

    def record(self, step: Step, key: str) -> None:
        """Record a CUDA event on the current stream (not while it captures a graph); no sync."""
        torch = self.cuda
        if torch is None or torch.cuda.is_current_stream_capturing():
            return
        event = step.events.get(key)
        if event is None:
            event = self.free_events.pop() if self.free_events else torch.cuda.Event(enable_timing=True)
            step.events[key] = event
        event.record()

    def read_events(self, wait: bool) -> None:
        """Elapsed times of the closed steps whose last event completed (all of them with ``wait``)."""
        if self.cuda is None:
            return
        if wait:
            self.cuda.cuda.synchronize()
        done = 0
        for step in self.pending:
            ev = step.events
            if not ev["end"].query():
                break
            step.step_cuda = ev["start"].elapsed_time(ev["end"]) * 1e3
            if "forward" in ev and "forward_end" in ev:
                step.forward_cuda = ev["forward"].elapsed_time(ev["forward_end"]) * 1e3
            self.free_events.extend(ev.values())
            step.events = {}
            self.dirty.add(step.category)
            done += 1
        del self.pending[:done]

    def flush(self, final: bool = False) -> None:
        """Write the summary (``steps_<pid>.json``, atomically replaced); ``final`` also closes the open step."""
        if final:
            if self.final:
                return
            self.final = True
            if self.step is not None:
                self.close(self.step, None)
                self.step = None
        with contextlib.ExitStack() as paused:
            for window in self.windows:  # a host window profiles the worker, not the probe's bookkeeping
                paused.enter_context(window.paused())
            self._write(final)

    def _write(self, final: bool) -> None:
        try:
            self.read_events(wait=final)
        except Exception as exc:  # a CUDA context torn down before the exit hook: keep the host times
            print(f"higgs_step_timing: CUDA events not read ({exc})", file=sys.stderr)
            self.cuda, self.pending = None, []
        self.since_flush, self.last_flush = 0, time.perf_counter()
        if not self.steps and not self.instances:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.summary(final), f, indent=1)
        os.replace(tmp, self.path)

    def summary(self, final: bool) -> dict:
        import multiprocessing

        return {
            "pid": self.pid, "ppid": os.getppid(), "process": multiprocessing.current_process().name,
            "argv": sys.argv[:6], "written": time.time(), "final": final, "classes": self.classes,
            "instances": self.instances, "cuda": self.cuda is not None, "cuda_pending": len(self.pending),
            "settings": {"every": self.every, "flush_s": self.flush_s, "idle_s": self.idle_s},
            "steps": sum(len(s) for s in self.steps.values()), "real_steps": self.real_steps,
            "idle_gaps": self.idle_gaps,
            "categories": self.categories(),
        }  # fmt: skip

    def categories(self) -> dict[str, dict]:
        for name in self.dirty:
            self.summaries[name] = summarize(self.steps[name])
        self.dirty.clear()
        return dict(sorted(self.summaries.items()))


def quantiles(values: list[float]) -> dict:
    """n, min, p50, p90, max, mean of ``values`` (linear interpolation between ranks); n only when empty."""
    if not values:
        return {"n": 0}
    xs = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    stats = {"min": xs[0], "p50": at(0.5), "p90": at(0.9), "max": xs[-1], "mean": sum(xs) / len(xs)}
    return {"n": len(xs)} | {k: round(v, 1) for k, v in stats.items()}


def summarize(steps: list[Step]) -> dict:
    """One category's steps: counts, batch sizes, interval / ours / probe / remainder, CUDA spans (us), methods."""
    timed = [s for s in steps if s.interval is not None]
    ours = [sum(s.spent.values()) * 1e6 for s in steps]
    sizes: dict[int, int] = {}
    for s in steps:
        sizes[s.batch] = sizes.get(s.batch, 0) + 1
    methods = {}
    for name in sorted({m for s in steps for m in s.spent}):
        per_step = [s.spent.get(name, 0.0) * 1e6 for s in steps]
        called = [s.spent[name] * 1e6 for s in steps if name in s.spent]
        methods[name] = {"calls": sum(s.calls.get(name, 0) for s in steps),
                         "mean_us": round(sum(per_step) / len(steps), 1),  # per step, zeros included: adds up to ours
                         "p50_us_called": quantiles(called).get("p50")}  # fmt: skip
    return {
        "steps": len(steps), "rows": sum(s.batch for s in steps),
        "tokens": sum(s.tokens for s in steps) if all(s.tokens is not None for s in steps) else None,
        "batch_sizes": {str(b): n for b, n in sorted(sizes.items())},
        "python_forward_steps": sum(s.forward for s in steps),
        "interval_us": quantiles([s.interval * 1e6 for s in timed]),
        "ours_us": quantiles(ours), "probe_us": quantiles([s.probe * 1e6 for s in steps]),
        "remainder_us": quantiles([(s.interval - sum(s.spent.values()) - s.probe) * 1e6 for s in timed]),
        "forward_cuda_us": quantiles([s.forward_cuda for s in steps if s.forward_cuda is not None]),
        "step_cuda_us": quantiles([s.step_cuda for s in steps if s.step_cuda is not None]),
        "methods": methods,
    }  # fmt: skip

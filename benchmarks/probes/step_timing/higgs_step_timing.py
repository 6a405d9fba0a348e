"""Step-timing probe: where a decode step's time goes inside a vLLM / vllm-omni worker that runs the talker.

Installed in every Python process by this folder's ``sitecustomize.py`` when ``HIGGS_STEP_TIMING_DIR`` is set and
the folder is on ``PYTHONPATH`` (inherited by the processes vLLM and vllm-omni spawn: engine core, Stage-0
worker). An import hook on ``sys.meta_path`` wraps the entry points of the classes in ``TARGETS`` when their
module is imported: our talker (``higgs_talker.vllm_plugin.talker``), the text-only bridge that drives it under
plain vLLM, vllm-omni's in-tree talker (``bench_omni.py --talkers upstream``) and vllm-omni's Stage-1 codec
(``HiggsAudioV3Code2Wav``: its ``forward`` alone, so every call is an ``other`` step of its own process, with its
interval and device span: what the codec costs a call, at 64 streams a loop over the requests' chunks). Nothing is
imported eagerly; a process that never imports those modules only pays one dict lookup per import.

Per step of the worker, wall clock (``time.perf_counter``):
- ``interval``: from the step's first entry point to the next step's: one turn of the worker's loop, runner and
  scheduler included. Intervals over ``HIGGS_STEP_TIMING_IDLE_S`` (1 s) are counted as idle gaps, not timed;
- each entry point's host time (top-level calls only: one called inside another, e.g. ``embed_input_ids`` in
  ``forward`` or ``set_bridge_requests`` in the bridge's ``update_state``, is its caller's time); ``ours`` is their
  sum, ``probe`` the probe's own bookkeeping (flushes included), ``remainder = interval - ours - probe``: what
  vLLM / vllm-omni's runner, scheduler and process hops cost between our calls.
On CUDA, ``torch.cuda.Event`` pairs recorded without synchronizing (none while a stream captures a graph) and read
only when a summary is written: ``forward_cuda`` (the device span of our Python ``forward``; a replayed vLLM
graph runs no Python forward) and ``step_cuda`` (from the step's first entry point to the end of its sampling).

A step opens at an entry point whose rank (``RANKS``: the runners' order within a step) is not above the last
one the open step saw; it is a real step when ``compute_logits`` ran and it had requests (named by
``prepare_runner_inputs`` / ``update_decode_step_metadata`` / ``set_bridge_requests``; for a class that names none,
the rows of ``compute_logits``). Kinds: ``decode`` (one token per request), ``prefill`` (some request more),
``replayed`` (no Python forward and no token count: a replayed FULL decode graph), ``other`` (dummy, profile and
capture runs); categories split them by batch size (1, 2-3, 4-7, ...).

``HIGGS_STEP_TIMING_KERNELS=SKIP,STEPS[,BATCH]`` also profiles STEPS decode steps of BATCH's size category (default
1) after SKIP of them with ``torch.profiler`` and writes each kernel's device time per step to ``kernels_<pid>.txt``;
``HIGGS_STEP_TIMING_HOST=SKIP,STEPS[,BATCH]`` profiles the entry points' thread with ``cProfile`` the same way
(``host_<pid>.txt``: functions by own and cumulative time per step); ``HIGGS_STEP_TIMING_PREFILL=SKIP,COUNT[,BATCH]``
traces whole prefill steps (``prefill_<pid>_<n>.json`` / ``.txt``). All three: ``higgs_kernel_window``.

``HIGGS_STEP_TIMING_SYNC_DEBUG=warn`` also has torch warn, once per line of Python, at each call that waits for the
GPU from the first entry point on (``_watch_syncs``): where a step's host waits, in our code or vLLM's.

``HIGGS_STEP_TIMING_SLOW_S=SECONDS`` (e.g. ``0.5``) also writes, for every top-level entry point call still running
after SECONDS, every thread's Python stack at that moment to ``slow_<pid>.txt``, then a line ``SLOW <entry point>
<seconds> s (after N real steps; batch B, tokens T)`` once the call returns: where a step that stalls (a compile on
first use, a lock, a wait for the GPU) spends its time. The stacks are read by a watchdog thread holding the GIL
(``_Watchdog``): ``faulthandler.dump_traceback_later`` reads them without it, and a Stage-0 worker died in the middle
of such a dump while its main thread ran Triton's code generator (h200_20261205b).

Output: ``$HIGGS_STEP_TIMING_DIR/steps_<pid>.json`` (atomically replaced) after the first real step, then when
``HIGGS_STEP_TIMING_EVERY`` (100) real steps and ``HIGGS_STEP_TIMING_FLUSH_S`` (2 s) have passed since the last
write, on SIGTERM (before the handler it replaces) and at exit (atexit and multiprocessing's finalizers; a process
killed outright with no SIGTERM first loses the steps since its last write, ``"final": false``;
``higgs_step_record`` keeps the steps and writes). Left to interpreter exit,
vLLM's client SIGKILLs its engine process and the workers under it (the talker's) 5 s after asking them to stop:
a worker slower to end loses its final write. To keep it, shut the engine down explicitly with a longer timeout
(``llm.llm_engine.engine_core.shutdown(timeout=...)``) and raise ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` below it,
as ``tests/vllm_plugin/serve_tiny.py`` does. ``summarize.py DIR`` prints the tables.

Limits: the remainder is not broken down (runner, scheduler, process hops); a replayed graph's inside and the GPU's
idle time inside an event span are not seen; an entry point that waits for the GPU (our ``make_omni_output`` waits
for the step before's rows) counts the wait as host time; the entry points are assumed to be called from one thread
(vLLM's and vllm-omni's runners do); the per-step records stay in memory (a few hundred bytes a step) and a write
re-summarises the categories that changed (on the 2-core CPU machine 83 ms for one category of 20,000 steps: probe
time).
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from higgs_kernel_window import parse as parse_window
from higgs_step_record import Recorder, Step

_PROBES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _PROBES not in sys.path:
    sys.path.append(_PROBES)  # benchmarks/probes: after_import, which the probes share
import after_import  # noqa: E402

RUNNER_CONTRACT = (
    "prepare_runner_inputs", "update_decode_step_metadata", "set_bridge_requests", "embed_input_ids", "forward",
    "make_omni_output", "compute_logits", "sample", "sample_codes", "postprocess", "post_sample_multimodal_outputs",
    "on_requests_finished", "on_requests_removed",
)  # fmt: skip


@dataclass(frozen=True)
class Target:
    cls: str
    methods: tuple[str, ...]
    names_requests: bool  # tells which requests a step holds (else the batch is the rows of compute_logits)
    is_model: bool = True  # count its instances


TARGETS = {
    "higgs_talker.vllm_plugin.talker": Target("HiggsTalkerForConditionalGeneration", RUNNER_CONTRACT, True),
    "higgs_talker.vllm_plugin.bridge": Target("TextOnlyBridge", ("update_state", "apply"), True, is_model=False),
    "vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_talker": Target(
        "HiggsAudioV3TalkerForConditionalGeneration", RUNNER_CONTRACT, False
    ),
    "vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_code2wav": Target(
        "HiggsAudioV3Code2Wav", ("forward",), False
    ),
}
# the order of the once-a-step entry points within a step (vllm-omni's AR runner, plain vLLM with the bridge);
# the others (postprocess per request, make_omni_output, on_requests_*) belong to the step they fall in
RANKS = {"update_state": 0, "set_bridge_requests": 1, "embed_input_ids": 2, "prepare_runner_inputs": 3,
         "update_decode_step_metadata": 4, "forward": 5, "compute_logits": 6, "sample": 7, "apply": 7,
         "sample_codes": 8}  # fmt: skip
MODEL_END = frozenset(("compute_logits", "sample", "sample_codes", "apply"))  # step_cuda ends after the last of these

_settings: dict[str, Any] = {}
_recorder: Recorder | None = None  # this process's; None until its first entry point, and again after a fork
_slow_file = None  # this process's slow_<pid>.txt where HIGGS_STEP_TIMING_SLOW_S is set (opened with the recorder)
_watchdog: _Watchdog | None = None  # its watchdog thread (started with the file)


def install(out_dir: str) -> None:
    """Put the import hook first on ``sys.meta_path`` (once); summaries go to ``out_dir``. A bad setting raises
    before anything is installed."""
    settings = dict(dir=out_dir, every=int(os.environ.get("HIGGS_STEP_TIMING_EVERY", "100")),
                    flush_s=float(os.environ.get("HIGGS_STEP_TIMING_FLUSH_S", "2")),
                    idle_s=float(os.environ.get("HIGGS_STEP_TIMING_IDLE_S", "1")),
                    slow_s=parse_slow(os.environ.get("HIGGS_STEP_TIMING_SLOW_S")))  # fmt: skip
    hooks = {name: functools.partial(_patch_module, target=target) for name, target in TARGETS.items()}
    if not after_import.install("step_timing", hooks):
        return
    _settings.update(settings)
    os.register_at_fork(after_in_child=_forget)


def parse_slow(value: str | None) -> float | None:
    """``HIGGS_STEP_TIMING_SLOW_S``: seconds > 0, or None when unset or empty; ValueError naming the value otherwise."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"HIGGS_STEP_TIMING_SLOW_S must be a number of seconds above 0, got {value!r}")
    return seconds


class _Watchdog:
    """A daemon thread that writes every thread's Python stack to ``file`` once a watched call has run ``seconds``:
    a call sets ``started`` (its ``perf_counter``) and clears it when it returns, two attribute writes; the thread
    looks four times a ``seconds`` and reads the stacks with ``sys._current_frames`` under the GIL, so the threads it
    reads are stopped between bytecodes."""

    def __init__(self, file, seconds: float) -> None:
        self.file, self.seconds = file, seconds
        self.started: float | None = None
        self.call = 0  # the watched call's number: one dump per call
        threading.Thread(target=self._run, name="higgs-step-timing-watchdog", daemon=True).start()

    def _run(self) -> None:
        dumped = -1
        while True:
            time.sleep(self.seconds / 4)
            started, call = self.started, self.call
            if started is not None and call != dumped and time.perf_counter() - started >= self.seconds:
                dumped = call
                self._dump(time.perf_counter() - started)

    def _dump(self, running: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        parts = [f"Running {running:.3f} s, every thread's stack (most recent call last):"]
        for ident, frame in sys._current_frames().items():
            if ident != me:
                parts.append(f"Thread {ident:#x} ({names.get(ident, '?')}):\n" + "".join(traceback.format_stack(frame)))
        print("\n".join(parts), file=self.file, flush=True)


def _forget() -> None:
    global _recorder, _slow_file, _watchdog
    _recorder = _slow_file = _watchdog = None  # a forked child starts its own record (the patched classes stay patched)


def _get_recorder() -> Recorder:
    global _recorder, _slow_file, _watchdog
    if _recorder is None:
        import multiprocessing.util

        windows = (parse_window(os.environ.get(f"HIGGS_STEP_TIMING_{w}"), f"HIGGS_STEP_TIMING_{w}")
                   for w in ("KERNELS", "HOST", "PREFILL"))  # fmt: skip
        _recorder = Recorder(_settings["dir"], _settings["every"], _settings["flush_s"], _settings["idle_s"],
                             _settings.setdefault("classes", []), *windows)  # fmt: skip
        atexit.register(_final_flush)
        multiprocessing.util.Finalize(None, _final_flush, exitpriority=100)  # a multiprocessing child's exit
        _flush_on_sigterm()
        _watch_syncs(os.environ.get("HIGGS_STEP_TIMING_SYNC_DEBUG"))
        if _settings.get("slow_s"):
            os.makedirs(_settings["dir"], exist_ok=True)
            _slow_file = open(os.path.join(_settings["dir"], f"slow_{os.getpid()}.txt"), "a", encoding="utf-8")  # noqa: SIM115
            _watchdog = _Watchdog(_slow_file, _settings["slow_s"])
    return _recorder


def _watch_syncs(mode: str | None) -> None:
    """``HIGGS_STEP_TIMING_SYNC_DEBUG=warn`` (or ``error``): from the first entry point on (start-up and graph
    capture left out), torch reports each call that waits for the GPU (a blocking copy, ``.item()``, a boolean
    of a CUDA tensor), warning once per line of Python that made it (``torch.cuda.set_sync_debug_mode``). An
    explicit ``Event.synchronize`` is not reported."""
    if mode:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(mode)


def _flush_on_sigterm() -> None:
    """Write the final record when the process is asked to stop (vLLM's client SIGTERMs its engine process, then
    SIGKILLs it after its timeout), then do what SIGTERM did before: the exit hooks may not get to run (a CI run
    under load lost the final write of an engine process that was asked to stop with 150 s to spare). Only the main
    thread may set a handler; elsewhere the exit hooks alone write."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        _final_flush()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def _final_flush() -> None:
    if _recorder is not None and _recorder.pid == os.getpid():
        _recorder.flush(final=True)


# ---------------------------------------------------------------------------------------------------- import hook


def _patch_module(module, target: Target) -> None:
    patch(getattr(module, target.cls), target)


def patch(cls: type, target: Target) -> None:
    """Wrap the target's entry points that ``cls`` has (and count instances of a model class)."""
    for name in target.methods:
        fn = getattr(cls, name, None)
        if callable(fn):
            setattr(cls, name, _timed(name, fn, target.names_requests))
    if target.is_model:
        init = cls.__init__

        @functools.wraps(init)
        def counted_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            _get_recorder().instances += 1

        cls.__init__ = counted_init
    _settings.setdefault("classes", []).append(f"{cls.__module__}:{cls.__qualname__}")


def _timed(name: str, fn, names_requests: bool):
    rank, observe, model_end = RANKS.get(name), OBSERVERS.get(name), name in MODEL_END

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        rec = _recorder or _get_recorder()
        if rec.depth:  # inside another entry point: its caller's time, but it may say what the step holds
            if observe is not None:
                observe(rec.step, names_requests, args, kwargs)
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        step = rec.enter(rank, t0)
        if observe is not None:
            observe(step, names_requests, args, kwargs)
            rec.observed(step)
        if name == "forward":
            step.forward = True
            rec.record(step, "forward")
        rec.depth = 1
        watchdog = _watchdog
        t1 = time.perf_counter()
        if watchdog is not None:
            watchdog.call, watchdog.started = watchdog.call + 1, t1
        try:
            return fn(*args, **kwargs)
        finally:
            t2 = time.perf_counter()
            rec.depth = 0
            if watchdog is not None:
                watchdog.started = None
                if t2 - t1 >= _settings["slow_s"]:
                    print(f"SLOW {name} {t2 - t1:.3f} s (after {rec.real_steps} real steps; batch {step.batch}, "
                          f"tokens {step.tokens})", file=_slow_file, flush=True)  # fmt: skip
            step.spent[name] = step.spent.get(name, 0.0) + (t2 - t1)
            step.calls[name] = step.calls.get(name, 0) + 1
            if name == "forward":
                rec.record(step, "forward_end")
            elif model_end:
                step.logits |= name == "compute_logits"
                rec.record(step, "end")
            step.probe += (t1 - t0) + (time.perf_counter() - t2)

    return wrapper


# ---------------------------------------------------------------------------------------------------- observers


def _arg(args: tuple, kwargs: dict, index: int, name: str):
    """Argument ``name`` of an entry point call, passed by keyword or at ``index`` (``self`` is 0), or None."""
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _name_requests(step: Step, req_ids) -> None:
    if req_ids is not None:
        step.batch, step.named = len(req_ids), True


def _runner_inputs(step: Step, names_requests: bool, args: tuple, kwargs: dict) -> None:
    """vllm-omni's AR runner: the step's request ids and tokens per request (a host array: no sync)."""
    _name_requests(step, kwargs.get("req_ids"))
    counts = kwargs.get("num_scheduled_tokens")
    if counts is not None and not getattr(counts, "is_cuda", False):
        counts = counts.tolist() if hasattr(counts, "tolist") else list(counts)
        step.tokens, step.longest = sum(counts), max(counts, default=0)


def _decode_metadata(step: Step, names_requests: bool, args: tuple, kwargs: dict) -> None:
    _name_requests(step, kwargs.get("req_ids"))


def _bridge_requests(step: Step, names_requests: bool, args: tuple, kwargs: dict) -> None:
    _name_requests(step, _arg(args, kwargs, 1, "req_ids"))


def _forward(step: Step, names_requests: bool, args: tuple, kwargs: dict) -> None:
    """The tokens the forward got (padded where vLLM pads for a graph); the runner's counts win."""
    if step.tokens is None:
        positions = _arg(args, kwargs, 2, "positions")  # [T], or [3, T] for M-RoPE
        embeds = kwargs.get("inputs_embeds")  # [T, H]
        if positions is not None:
            step.tokens = int(positions.shape[-1])
        elif embeds is not None:
            step.tokens = int(embeds.shape[0])


def _logits(step: Step, names_requests: bool, args: tuple, kwargs: dict) -> None:
    if not names_requests and not step.named:
        hidden = _arg(args, kwargs, 1, "hidden_states")
        step.batch = int(hidden.shape[0]) if hidden is not None else 0


OBSERVERS = {"prepare_runner_inputs": _runner_inputs, "update_decode_step_metadata": _decode_metadata,
             "set_bridge_requests": _bridge_requests, "forward": _forward, "compute_logits": _logits}  # fmt: skip

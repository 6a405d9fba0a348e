"""Helpers shared by the benchmark scripts: timing, the copy-bandwidth ceiling, JSON output, tables.

Timing follows one rule everywhere: warm up first, time with CUDA events (a host clock on CPU), repeat, and
report the median. Every script writes its JSON after each row, so a crash or a time-out keeps what was done.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run from a checkout without installing: make higgs_talker importable
    sys.path.append(str(REPO_ROOT))


# ---------------------------------------------------------------------------------------------------------
# sampling

# The named samplings of ``--sampling`` (bench_decode, bench_e2e, bench_vllm): ``deploy`` is the deploy profiles'
# ``default_sampling_params`` (higgs_talker/vllm_plugin/deploy/*.yaml; the requests are seeded), the headline;
# ``greedy`` the argmax, the cheapest sampler (full-decode graphs replay an argmax-only variant for it).
SAMPLINGS: dict[str, dict[str, float | int]] = {
    "deploy": {"temperature": 1.0, "top_p": 0.95, "top_k": 50},
    "greedy": {"temperature": 0.0},
}
DEFAULT_SAMPLINGS = ["deploy", "greedy"]


def add_sampling_option(parser: argparse.ArgumentParser, every: str) -> None:
    """``--sampling`` (``samplings_arg``; default ``DEFAULT_SAMPLINGS``): the samplings run at ``every`` point or
    level of a benchmark, the first the headline."""
    deploy = ", ".join(f"{k} {v}" for k, v in SAMPLINGS["deploy"].items())
    parser.add_argument(
        "--sampling", type=samplings_arg, default=list(DEFAULT_SAMPLINGS),
        help=f"samplings to run at every {every}, the first the headline (of {', '.join(SAMPLINGS)}; default "
        f"{','.join(DEFAULT_SAMPLINGS)}: deploy = the deploy profiles' {deploy}, seeded)",
    )  # fmt: skip


def samplings_arg(text: str) -> list[str]:
    """Comma-separated sampling names (argparse type): each once, in the order given."""
    names = list(dict.fromkeys(x for x in text.split(",") if x))
    bad = [n for n in names if n not in SAMPLINGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown sampling(s) {bad or [text]}; choose from {list(SAMPLINGS)}")
    return names


# ---------------------------------------------------------------------------------------------------------
# environment


def now_stamp() -> str:
    """Local date-time for file names: 20261129-231500."""
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def package_version(name: str) -> str | None:
    """Version of an importable package, or None when it is not installed (or fails to import)."""
    try:
        module = __import__(name)
    except Exception:  # noqa: BLE001 - a broken install counts as missing
        return None
    return str(getattr(module, "__version__", "unknown"))


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The exact command: ``python benchmarks/<script> <args>`` (argv None: this process's own arguments)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(shlex.quote(a) for a in ["python", f"benchmarks/{script}", *args])


def cpu_model(cpuinfo: str | None = None) -> str:
    """The host's CPU as ``/proc/cpuinfo`` names it, with the cores this process may use (two machines of one GPU
    kind can differ here, and host-bound figures with them); the architecture where there is no cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{names[0] if names else platform.processor() or platform.machine()} ({cores} cores)"


def gpu_limits(device: torch.device) -> str | None:
    """The GPU's power limit, top SM clock and driver as ``nvidia-smi`` reports them (read only), or None where it
    cannot say (no CUDA device, no nvidia-smi): two cards of one name can run at different limits."""
    if device.type != "cuda":
        return None
    fields = "power.limit,clocks.max.sm,driver_version"
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid).removeprefix("GPU-")  # renumbering keeps it
        cmd = ["nvidia-smi", f"--id=GPU-{uuid}", f"--query-gpu={fields}", "--format=csv,noheader"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (AttributeError, OSError, subprocess.SubprocessError):
        return None
    power, clock, driver = ([*map(str.strip, out.split(",")), "", ""])[:3]
    return f"power limit {power}, max SM clock {clock}, driver {driver}" if out else None


def environment(device: torch.device, script: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """The ``meta`` block every JSON carries: date, GPU (and its limits), host CPU, versions, exact command."""
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)"
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(script, argv),
        "device": str(device),
        "gpu": gpu,
        "gpu_limits": gpu_limits(device),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": package_version("flashinfer"),
        "transformers": package_version("transformers"),
        "triton": package_version("triton") if device.type == "cuda" else None,
    }


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available on this machine (use --device cpu --tiny)")
    return device


# ---------------------------------------------------------------------------------------------------------
# timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: Iterable[float]) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return float("nan")
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


class StepTimer:
    """Time individual host-driven steps: CUDA events on GPU (read after one sync at the end), perf_counter on CPU.

    ``with timer: step()`` per step; ``timer.ms()`` returns every step's milliseconds.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host: list[float] = []
        self._t0 = 0.0

    def __enter__(self) -> StepTimer:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, end))
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._events[-1][1].record()
        self._host.append((time.perf_counter() - self._t0) * 1e3)

    def ms(self) -> list[float]:
        if not self.cuda:
            return list(self._host)
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in self._events]

    def host_ms(self) -> list[float]:
        return list(self._host)


def capture_graph(fn: Callable[[], Any], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Capture ``fn`` in a CUDA graph after ``warmup`` eager calls on a side stream (PyTorch's recipe)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_fn(
    fn: Callable[[], Any], device: torch.device, repeats: int = 5, target_ms: float = 5.0, max_inner: int = 500
) -> dict[str, float]:
    """Median milliseconds per call of ``fn`` (a graph replay or an eager call).

    One call warms up and calibrates how many calls one repeat makes (about ``target_ms`` each); each of
    ``repeats`` repeats is timed as a block with CUDA events (perf_counter on CPU).
    """
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    one = max((time.perf_counter() - t0) * 1e3, 1e-3)
    inner = int(min(max_inner, max(3, math.ceil(target_ms / one))))
    per_call = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            per_call.append((time.perf_counter() - t0) * 1e3 / inner)
    med = median(per_call)
    return {
        "ms": med,
        "min_ms": min(per_call),
        "max_ms": max(per_call),
        "spread": (max(per_call) - min(per_call)) / med if med else float("nan"),
        "calls_per_repeat": inner,
        "repeats": repeats,
    }


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 7) -> dict[str, float]:
    """The memory ceiling: a large device-to-device copy, counting bytes read plus bytes written.

    Returns ``{"bytes_per_s", "tb_per_s", "nbytes"}``; 2 GiB per buffer on CUDA, 64 MiB on CPU by default.
    """
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 64 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_(-1, 1)  # never zeros
    dst = torch.empty_like(src)
    res = time_fn(lambda: dst.copy_(src), device, repeats=repeats, target_ms=20.0, max_inner=20)
    moved = 2 * src.numel() * src.element_size()
    bps = moved / (res["ms"] / 1e3)
    return {"bytes_per_s": bps, "tb_per_s": bps / 1e12, "nbytes": moved, "spread": res["spread"]}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN/inf anywhere in ``out`` gives inf."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def error_text(exc: BaseException) -> str:
    """One line for a JSON row: the exception type, message and the innermost frame."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}{where}"[:500]


# ---------------------------------------------------------------------------------------------------------
# output


SMOKE_DIR = Path(tempfile.gettempdir()) / "higgs_talker_smoke"


class ResultFile:
    """A JSON file ``{"meta": ..., "rows": [...], ...}`` rewritten (atomically) after every change: in ``out_dir``,
    else ``results/``, or for a smoke run (``smoke``: a tiny shape, nothing to keep) a temporary folder, so that it
    neither lands beside the committed results nor becomes the newest file ``plot.py`` finds."""

    def __init__(
        self,
        out_dir: str | Path | None,
        prefix: str,
        meta: dict[str, Any],
        name: str | None = None,
        smoke: bool = False,
    ) -> None:
        self.dir = Path(out_dir) if out_dir else SMOKE_DIR if smoke else RESULTS_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / (name or f"{prefix}_{now_stamp()}.json")
        self.data: dict[str, Any] = {"meta": meta, "rows": []}
        self.save()

    @property
    def meta(self) -> dict[str, Any]:
        return self.data["meta"]

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.data["rows"]

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        self.rows.append(row)
        self.save()
        return row

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default, allow_nan=True) + "\n")
        os.replace(tmp, self.path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype | torch.device):
        return str(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    return repr(obj)


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.2e}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{max(digits - 1, 1)}f}"
    return str(value)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str | tuple[str, str]], title: str = "") -> str:
    """Print rows as a Markdown table; ``columns`` are keys or (key, header) pairs. Returns the text."""
    cols = [(c, c) if isinstance(c, str) else c for c in columns]
    cells = [[fmt(r.get(k)) for k, _ in cols] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, (_, h) in enumerate(cols)]
    lines = []
    if title:
        lines.append(title)
    lines.append("| " + " | ".join(h.ljust(w) for (_, h), w in zip(cols, widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def log(msg: str) -> None:
    """Progress lines go to stderr so the table on stdout stays clean."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ints_arg(text: str) -> list[int]:
    """Comma-separated integers (argparse type)."""
    return [int(x) for x in text.split(",") if x]


def floats_arg(text: str) -> list[float]:
    """Comma-separated numbers (argparse type)."""
    return [float(x) for x in text.split(",") if x]


def strs_arg(text: str) -> list[str]:
    """Comma-separated names (argparse type)."""
    return [x for x in text.split(",") if x]

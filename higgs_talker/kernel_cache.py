"""Kernels built ahead of time: ``warmup()`` builds every kernel a checkpoint needs, and reports where they live.

On CUDA, FlashInfer JIT-compiles each kernel the first time it is used (paged prefill, native paged decode,
XQA, RMSNorm, RoPE, SiLU-and-mul) and keeps the shared library in its cache directory; on the H200 (4B shape) a
warm-up into an empty cache took 215 s, a start on the cache it filled 21.8 s
(benchmarks/results/coldstart_20261201-143503.json). ``warmup`` does what a server's start
does (load the talker, which measures the decode kernels and captures the CUDA graphs), then runs one short
generation (a prefill and a few decode steps), so every kernel the engine launches for that checkpoint's shapes
and dtype is built once. Later processes that see the same cache directory load the libraries from disk.

FlashInfer reads its cache location once, when it is imported: ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``,
by default ``~/.cache/flashinfer`` (the JIT libraries are in ``<arch>/cached_ops`` there). tvm-ffi, through
which FlashInfer loads them, may build a small helper of its own into ``$TVM_FFI_CACHE_DIR`` (default
``~/.cache/tvm-ffi``). Triton keeps our kernels (the fused QK-norm/RoPE/K-V kernel, the one-row GEMV's tiles,
the frame's kernels) in ``$TRITON_CACHE_DIR`` (default ``~/.triton/cache``, read when a kernel compiles).
``use_cache_dir(base)`` points all three under one directory; it must run before anything imports FlashInfer.
On CPU there is nothing to build: the CPU path runs torch's precompiled kernels.

Warm-up also keeps what it measured (the one-row GEMV tiles, each bucket's decode kernel and graph path) in the
choice cache (``cuda_graphs.choice_cache``), ``$HIGGS_TALKER_CHOICE_CACHE`` (default
``~/.cache/higgs_talker/choices``): a later start with the same GPU, versions, shapes and options checks those
choices instead of timing them. ``use_cache_dir(base)`` moves it to ``base/.cache/higgs_talker/choices``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .api import HiggsTalker, _checked_checkpoint, _engine_config, _resolve_runtime
from .bytecode import ENV as BYTECODE_VAR
from .cuda_graphs.choice_cache import CHOICE_CACHE_VAR, default_choice_dir
from .heads.sampling import SamplingParams

FLASHINFER_BASE_VAR = "FLASHINFER_WORKSPACE_BASE"  # read by flashinfer/jit/env.py at import
TVM_FFI_VAR = "TVM_FFI_CACHE_DIR"
TRITON_VAR = "TRITON_CACHE_DIR"  # read by triton when it compiles
# what a compiled kernel is in each cache: FlashInfer's and tvm-ffi's shared libraries, Triton's GPU binaries
MODULE_GLOBS = {"flashinfer": "*.so", "tvm_ffi": "*.so", "triton": "*.cubin", "choices": "*.json"}
WARMUP_TEXT = "One short sentence, through prefill and decode."
WARMUP_FRAMES = 16


def cache_env(base: str | Path) -> dict[str, str]:
    """The environment that puts FlashInfer's cache in ``base/.cache/flashinfer``, tvm-ffi's in
    ``base/.cache/tvm-ffi`` (the layout they use under the home directory), Triton's in ``base/.cache/triton``,
    the measured choices in ``base/.cache/higgs_talker/choices`` and the bytecode ``warmup`` writes (``bytecode``)
    in ``base/.cache/higgs_talker/bytecode``."""
    base = Path(base).expanduser().absolute()
    return {FLASHINFER_BASE_VAR: str(base), TVM_FFI_VAR: str(base / ".cache" / "tvm-ffi"),
            TRITON_VAR: str(base / ".cache" / "triton"),
            CHOICE_CACHE_VAR: str(base / ".cache" / "higgs_talker" / "choices"),
            BYTECODE_VAR: str(base / ".cache" / "higgs_talker" / "bytecode")}  # fmt: skip


def cache_dirs() -> dict[str, Path]:
    """Where this process's kernels are cached: ``{"flashinfer": dir, "tvm_ffi": dir, "triton": dir}``, plus
    ``"choices"``: the choice cache's directory, unless ``$HIGGS_TALKER_CHOICE_CACHE`` turns it off.

    FlashInfer's own value once it is imported (it fixes the location then), else the rule it will apply.
    """
    loaded = sys.modules.get("flashinfer.jit.env")
    if loaded is not None:
        flashinfer = Path(loaded.FLASHINFER_CACHE_DIR)
    else:
        flashinfer = Path(os.environ.get(FLASHINFER_BASE_VAR, str(Path.home()))) / ".cache" / "flashinfer"
    triton = os.environ.get(TRITON_VAR) or str(Path(os.environ.get("TRITON_HOME", "~")) / ".triton" / "cache")
    choices = default_choice_dir()
    return {"flashinfer": flashinfer, "tvm_ffi": Path(os.environ.get(TVM_FFI_VAR, "~/.cache/tvm-ffi")).expanduser(),
            "triton": Path(triton).expanduser()} | ({"choices": choices} if choices is not None else {})  # fmt: skip


def count_modules(path: Path, pattern: str = "*.so") -> int:
    """Compiled kernels (files matching ``pattern``) under ``path``; 0 when it does not exist."""
    return sum(1 for _ in path.rglob(pattern)) if path.is_dir() else 0


def count_all(caches: dict[str, Path]) -> dict[str, int]:
    """``count_modules`` of each cache, with the pattern of its kind (``MODULE_GLOBS``)."""
    return {name: count_modules(path, MODULE_GLOBS.get(name, "*.so")) for name, path in caches.items()}


def use_cache_dir(base: str | Path) -> dict[str, Path]:
    """Point this process's kernel caches under ``base`` (created if missing; ``cache_env``); returns
    ``cache_dirs()``. Sets environment variables, so it must run before FlashInfer is imported."""
    path = Path(base).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"cache dir {str(path)!r} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cache dir {str(path)!r} cannot be created: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"cache dir {str(path)!r} is not writable")
    env = cache_env(path)
    loaded = sys.modules.get("flashinfer.jit.env")
    if loaded is not None and Path(loaded.FLASHINFER_BASE_DIR).absolute() != Path(env[FLASHINFER_BASE_VAR]):
        raise ValueError(
            f"cache dir {str(path)!r}: FlashInfer is already imported here with its cache in "
            f"{loaded.FLASHINFER_CACHE_DIR}, and it reads the location only at import; set it before that"
        )
    os.environ.update(env)
    return cache_dirs()


@dataclass(frozen=True)
class WarmupReport:
    """What ``warmup`` did. ``compiled`` is False where nothing needs building (CPU, or CUDA without FlashInfer)."""

    checkpoint: str
    device: str
    dtype: str
    graph_mode: str
    compiled: bool
    kernels: str  # "flashinfer" or "torch"
    load_s: float  # CUDA: from_pretrained, graph warm-up included; CPU: the checkpoint check
    graph_warmup_s: float = 0.0  # decode-kernel choice and graph capture, inside load_s
    generate_s: float = 0.0
    rows: int = 0  # rows of the warm-up generation (the prefill's, then one per decode step)
    caches: dict[str, Path] = field(default_factory=dict)
    modules_before: dict[str, int] = field(default_factory=dict)
    modules_after: dict[str, int] = field(default_factory=dict)
    # where the measured choices came from ("measured", "cached", "remeasured"; "none": nothing to choose) and the
    # choice-cache entry written or read (None: no cache)
    choices: str = "none"
    choice_file: Path | None = None

    @property
    def total_s(self) -> float:
        return self.load_s + self.generate_s

    def lines(self) -> list[str]:
        """A few lines for a person: what ran, how long it took, where the kernels are."""
        head = f"warmup: {self.checkpoint} on {self.device} ({self.dtype}"
        if self.device.startswith("cpu"):
            return [
                f"{head}): nothing to compile (the CPU path runs torch's prebuilt kernels)",
                f"checked the checkpoint (config, tokenizer, weights header, memory) in {self.load_s:.2f} s",
            ]
        out = [
            f"{head}, graph mode {self.graph_mode}, kernels {self.kernels})",
            f"loaded in {self.load_s:.1f} s (decode-kernel choice and CUDA graph capture {self.graph_warmup_s:.1f} s); "
            f"one generation (prefill + {max(self.rows - 1, 0)} decode steps) in {self.generate_s:.1f} s; "
            f"{self.total_s:.1f} s in all",
        ]
        if not self.compiled:
            return [*out, "FlashInfer is not installed: CUDA runs torch kernels and SDPA, so nothing was compiled"]
        labels = (("flashinfer", "FlashInfer kernel cache"), ("tvm_ffi", "tvm-ffi cache"), ("triton", "Triton cache"))
        for name, label in ((n, lab) for n, lab in labels if n in self.caches):
            after = self.modules_after.get(name, 0)
            new = after - self.modules_before.get(name, 0)
            out.append(f"{label}: {self.caches[name]} ({after} compiled module{'' if after == 1 else 's'}, {new} new)")
        out.append(self._choice_line())
        out.append(
            f"later processes that see these directories (same GPU, CUDA, FlashInfer and triton) skip the builds; "
            f"{FLASHINFER_BASE_VAR}, {TVM_FFI_VAR}, {TRITON_VAR} and {CHOICE_CACHE_VAR} move them"
        )
        return out

    def _choice_line(self) -> str:
        """Where the measured choices (GEMV tiles, decode kernels, graph paths) are kept, and where these came from."""
        if self.choice_file is None:
            off = "choice_cache=False or $" + CHOICE_CACHE_VAR + "=off"
            what = "nothing to choose" if self.choices == "none" else f"choices {self.choices}, kept nowhere ({off})"
            return f"choice cache: {what}"
        after = self.modules_after.get("choices", 0)
        return (f"choice cache: {self.choice_file.parent} ({after} entr{'y' if after == 1 else 'ies'}); this start's "
                f"choices {self.choices}, entry {self.choice_file.name}")  # fmt: skip


def warmup(
    checkpoint: str | Path = "tiny",
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    graph_mode: str | None = None,
    frames: int = WARMUP_FRAMES,
    choice_cache: str | Path | bool | None = None,
    **engine_options,
) -> WarmupReport:
    """Build every kernel the engine needs for ``checkpoint`` on ``device`` (default: CUDA when available).

    CUDA: ``HiggsTalker.from_pretrained`` with these options (codec off), then one generation of at most
    ``frames`` frames. CPU: nothing to build; the checkpoint is checked as ``from_pretrained`` checks it before
    allocating (config, tokenizer, weights header, memory), without loading it. ``engine_options`` as for
    ``from_pretrained`` (``max_model_len``, ...). The load fills the choice cache (``choice_cache`` as for
    ``from_pretrained``; default ``$HIGGS_TALKER_CHOICE_CACHE`` or ``~/.cache/higgs_talker/choices``), or checks
    the entry it finds there.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev, dt, mode = _resolve_runtime(device, dtype, graph_mode)
    engine_config = _engine_config(engine_options)  # a bad option fails here, before anything is read
    params = SamplingParams(seed=0, max_frames=frames)
    caches = cache_dirs()
    before = count_all(caches)
    start = time.perf_counter()
    common = dict(checkpoint=str(checkpoint), device=str(dev), dtype=str(dt).removeprefix("torch."))
    if dev.type != "cuda":
        _checked_checkpoint(checkpoint, engine_config, dev, dt)
        return WarmupReport(**common, graph_mode=mode.value, compiled=False, kernels="torch",
                            load_s=time.perf_counter() - start)  # fmt: skip
    talker = HiggsTalker.from_pretrained(checkpoint, dev, dt, graph_mode=graph_mode, codec=False,
                                         choice_cache=choice_cache, **engine_options)  # fmt: skip
    torch.cuda.synchronize(dev)
    loaded = time.perf_counter()
    result = talker.generate(WARMUP_TEXT, params)
    torch.cuda.synchronize(dev)
    done = time.perf_counter()
    caches = cache_dirs()  # FlashInfer's own value, now that it is imported
    kernels = talker.model.kernels.name
    graphs = talker.engine.graphs
    if graphs is not None and graphs.choice_file is not None:
        caches["choices"] = graphs.choice_file.parent  # the directory this start used (choice_cache=DIR included)
    return WarmupReport(
        **common,
        graph_mode=talker.graph_mode.value,
        compiled=kernels == "flashinfer",
        kernels=kernels,
        load_s=loaded - start,
        graph_warmup_s=graphs.warmup_s if graphs is not None else 0.0,
        generate_s=done - loaded,
        rows=int(result.rows.shape[0]),
        caches=caches,
        modules_before=before,
        modules_after=count_all(caches),
        choices=graphs.choices_source if graphs is not None else "none",
        choice_file=graphs.choice_file if graphs is not None else None,
    )

"""The per-step frame work as Triton kernels on CUDA (``triton_kernels``), each used once it matched its torch
reference.

At batch 1 the torch version of a frame (``slots.sample_frame``) is about 260 small launches: the sampler's
noise hash 121, the delay mask 29, the state update 45, the rest gathers, filters and the argmax. A CUDA graph
replays them all at every decode step. Three kernels take the hash, the mask and the update: the same integer
and boolean operations, so their results are equal to the references' (``sampling.noise_words``,
``delay.apply_delay_mask``, ``delay.update_state``), not merely close.

Each kernel is used on CUDA where triton imports, and only for call signatures (dtypes, shapes, strides,
alignment: what Triton compiles a variant for) whose first use outside a graph capture gave exactly its
reference's result on the same inputs (one sync per signature, once per process); an import error, a launch
error or any difference turns that kernel off with one warning and the reference runs from then on. Inside a
capture an unchecked signature is not used (the capture keeps the reference). ``ENABLED = False`` turns all
of them off, ``DISABLED`` those it names (benchmarks' A/B).

A fourth, the race (``triton_kernels.race_argmax``), runs the sampler itself for a sampled step: temperature, the
top-k/top-p filter over a stable sort (of the top-k candidates alone where they are at most 64, found by bisection
over the values' bits), the noise and the argmax, one program per (request, codebook) row, where
torch takes about 30 launches besides the noise kernel (the sort, its gathers and scatters, a softmax and a cumsum
in both directions, the noise's logs, the race). Its filter sums the nucleus mass in its own order, and on a GPU
its ``exp``/``log`` are Triton's, so a code can differ from the reference's where two candidates' scores or the
nucleus mass and ``1 - top_p`` are within a few ulps: its first use per signature is checked like the others', and
a difference turns it off. On an H100 (2026-12-06, ``bench_decode.py --race-kernel both``, 4B shape, deploy
sampling) it took 0.03 / 0.05 / 0.06 ms off a step of 1 / 16 / 64 requests (about 1 %), with its GPU test passing;
sorting only the top-k candidates, 0.09 / 0.14 / 0.19 ms (a sampled step 1.003x / 1.007x / 0.999x the greedy one,
against 1.03x with the torch race; H100, ``results/h100_20261206e``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

ENABLED = True
# kernels turned off by name (benchmarks' A/B of one kernel): none by default
DISABLED: set[str] = set()
MASK_MAX_VOCAB = 1 << 16  # the mask kernel holds one codebook row in one block
RACE_MAX_VOCAB = 1 << 13  # the race kernel sorts one codebook row of int64 keys in one block
T = TypeVar("T")
_state: dict[str, str] = {}  # kernel name -> "off" once it failed a check or errored
_checked: dict[str, set[tuple]] = {}  # kernel name -> the call signatures whose first use matched the reference
_MASK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def noise_supports(n: int, code_key: int) -> bool:
    """Whether the noise kernel equals the torch hash for ``n`` codes per row: every index plus ``code_key`` must
    stay a 32-bit word (true for any real codebook table: with sampling's key the limit is about 1.6e9 codes)."""
    return n > 0 and code_key >= 0 and n - 1 + code_key < 2**32


def delay_mask_supports(logits: Tensor) -> bool:
    """Whether the mask kernel takes these logits: [B, C, V] fp16/bf16/fp32/fp64 with unit stride along V, V
    within one block, and rows that do not overlap (the kernel writes every row in place from its own program)."""
    if logits.dim() != 3 or logits.dtype not in _MASK_DTYPES:
        return False
    b, c, v = logits.shape
    s0, s1, s2 = logits.stride()
    apart = (c == 1 or s1 >= v) and (b == 1 or s0 >= (c - 1) * s1 + v)
    return s2 == 1 and v <= MASK_MAX_VOCAB and apart


def race_supports(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor, steps: Tensor, code_key: int
) -> bool:
    """Whether the race kernel takes these: logits [B, C, V] fp16/bf16/fp32 with unit stride along V and V within
    one block, temperature and top_p [B] fp32, top_k, seeds and steps [B] int64, and noise words for C * V codes."""
    if logits.dim() != 3 or logits.dtype not in _MASK_DTYPES[:3] or logits.stride(2) != 1:
        return False
    b, c, v = logits.shape
    per_row = ((temperature, torch.float32), (top_p, torch.float32), (top_k, torch.long), (seeds, torch.long),
               (steps, torch.long))  # fmt: skip
    return (
        0 < v <= RACE_MAX_VOCAB
        and all(t.dim() == 1 and t.shape[0] == b and t.dtype == dtype for t, dtype in per_row)
        and noise_supports(c * v, code_key)
    )


def _on_kernel_device(t: Tensor) -> bool:
    return t.is_cuda


def stream_is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA); ``cuda_graphs`` uses it too."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _kernels():
    return importlib.import_module(f"{__package__}.triton_kernels")


def state(name: str) -> str:
    """``off`` (failed a check or errored), ``ok`` (in use: checked for at least one call signature) or
    ``untried``."""
    if _state.get(name) == "off":
        return "off"
    return "ok" if _checked.get(name) else "untried"


def signature(*args: object) -> tuple:
    """A call's signature: each tensor's dtype, shape, strides and 16-byte alignment; other arguments as given."""
    return tuple(
        (a.dtype, tuple(a.shape), a.stride(), a.data_ptr() % 16 == 0) if isinstance(a, Tensor) else a for a in args
    )


def run_checked(
    name: str,
    device_tensor: Tensor,
    fused: Callable[[object, bool], T],
    reference: Callable[[bool], T],
    same: Callable[[T, T], bool],
    key: tuple = (),
    supported: Callable[[], bool] | None = None,
) -> T:
    """``fused(kernels, checking)`` where the kernel is on and checked for this call's ``signature(*key)``, else
    ``reference(checking)``; on a signature's first use, both on the same inputs (``checking=True``: neither may
    write its inputs), compared by ``same``. ``supported``: whether the kernel takes this call, asked only of a
    signature not yet checked (what it reads, dtypes, shapes and strides, is in the key); no: the reference."""
    if not ENABLED or name in DISABLED or _state.get(name) == "off" or not _on_kernel_device(device_tensor):
        return reference(False)
    sig = signature(*key)
    if sig in _checked.get(name, ()):
        return fused(_kernels(), False)
    if supported is not None and not supported():
        return reference(False)
    if stream_is_capturing():
        return reference(False)  # unchecked, and a capture cannot check it
    want = reference(True)
    try:
        got = fused(_kernels(), True)
    except Exception as exc:  # noqa: BLE001 - no triton, a compile or launch error: the reference it is
        _state[name] = "off"
        logger.warning("fused %s unavailable (%s: %s); using its torch reference", name, type(exc).__name__, exc)
        return want
    # outside the try: the comparison waits for the device, and what fails there (a synchronizing call where
    # none is allowed, an earlier step's fault) is not the kernel's
    if not same(got, want):
        _state[name] = "off"
        logger.warning("fused %s differs from its torch reference on this device; using the reference", name)
        return want
    _checked.setdefault(name, set()).add(sig)
    return got


def same_values(a: Tensor, b: Tensor) -> bool:
    """Equal shapes, dtypes and values, NaN matching NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)

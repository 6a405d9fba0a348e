"""The per-step frame work as Triton kernels on CUDA (``triton_kernels``), each used once it matched its torch
reference.

At batch 1 the torch version of a frame (``slots.sample_frame``) is about 260 small launches: the sampler's
noise hash 121, the delay mask 29, the state update 45, the rest gathers, filters and the argmax. A CUDA graph
replays them all at every decode step. Three kernels take the hash, the mask and the update: the same integer
and boolean operations, so their results are equal to the references' (``sampling.noise_words``,
``delay.apply_delay_mask``, ``delay.update_state``), not merely close.

Each kernel is used on CUDA where triton imports, and only after its first use outside a graph capture gave
exactly its reference's result on the same inputs (one sync, once per process); an import error, a launch
error or any difference turns that kernel off with one warning and the reference runs from then on. Inside a
capture an unchecked kernel is not used (the capture keeps the reference). ``ENABLED = False`` turns all three
off (benchmarks' A/B).
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
MASK_MAX_VOCAB = 1 << 16  # the mask kernel holds one codebook row in one block
T = TypeVar("T")
_state: dict[str, str] = {}  # kernel name -> "ok" | "off" (absent: not tried yet)


def noise_supports(n: int, code_key: int) -> bool:
    """Whether the noise kernel equals the torch hash for ``n`` codes per row: every index plus ``code_key`` must
    stay a 32-bit word (true for any real codebook table: with sampling's key the limit is about 1.6e9 codes)."""
    return n > 0 and code_key >= 0 and n - 1 + code_key < 2**32


def delay_mask_supports(logits: Tensor) -> bool:
    """Whether the mask kernel takes these logits: [B, C, V] floats with unit stride along V, V within one block."""
    if logits.dim() != 3 or not logits.is_floating_point():
        return False
    return logits.stride(2) == 1 and logits.shape[2] <= MASK_MAX_VOCAB


def _on_kernel_device(t: Tensor) -> bool:
    return t.is_cuda


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _kernels():
    return importlib.import_module(f"{__package__}.triton_kernels")


def state(name: str) -> str:
    """``ok`` (checked and in use), ``off`` (failed its check or errored) or ``untried``."""
    return _state.get(name, "untried")


def run_checked(
    name: str,
    device_tensor: Tensor,
    fused: Callable[[object, bool], T],
    reference: Callable[[bool], T],
    same: Callable[[T, T], bool],
) -> T:
    """``fused(kernels, checking)`` where the kernel is on and checked, else ``reference(checking)``; on the
    first use, both on the same inputs (``checking=True``: neither may write its inputs), compared by ``same``."""
    status = state(name)
    if not ENABLED or status == "off" or not _on_kernel_device(device_tensor):
        return reference(False)
    if status == "ok":
        return fused(_kernels(), False)
    if _capturing():
        return reference(False)  # unchecked, and a capture cannot check it
    want = reference(True)
    try:
        got = fused(_kernels(), True)
        equal = same(got, want)
    except Exception as exc:  # noqa: BLE001 - no triton, a compile or launch error: the reference it is
        _state[name] = "off"
        logger.warning("fused %s unavailable (%s: %s); using its torch reference", name, type(exc).__name__, exc)
        return want
    if not equal:
        _state[name] = "off"
        logger.warning("fused %s differs from its torch reference on this device; using the reference", name)
        return want
    _state[name] = "ok"
    return got


def same_values(a: Tensor, b: Tensor) -> bool:
    """Equal shapes, dtypes and values, NaN matching NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)

"""Programmatic dependent launch (PDL) for our Triton kernels on Hopper and later GPUs.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still running: its programs
become resident as that kernel's programs retire, and each waits (``gdc_wait``, PTX ``griddepcontrol.wait``) until
the previous kernel has completed and its writes are visible before it reads or writes anything. So a kernel's launch
and ramp hide behind the tail of the one before it. The previous kernel may let its dependents launch before it ends
(``gdc_launch_dependents``); ours do after their main loop. FlashInfer launches its kernels this way on Hopper; ours
(the one-row GEMV, the decode attention) do where ``enabled(device)`` holds. CUDA graphs keep the dependency.

The wait is the first thing such a kernel does, so it never reads a buffer the previous kernel is still writing, nor
writes one it is still reading: the greedy codes with it equal those without, bit for bit (``tests/test_gpu.py``). On
an H100 it took a sampled 4B step at batch 1 from 3.41 to 3.24 ms (1.40x -> 1.33x the HBM floor), where four of a
layer's seven kernels are ours; at 16 and 64 requests, where cuBLAS runs the linears, it changed nothing beyond the
noise (``bench_decode.py --modes auto --pdl both``, ``results/h100_20261206e``). ``ENABLED = False`` turns it off
(benchmarks' A/B). Never under the Triton interpreter (which has no ``griddepcontrol``).
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = True


def enabled(device: torch.device) -> bool:
    """Whether our kernels on ``device`` launch with PDL: a CUDA device of compute capability 9.0 or later, the
    interpreter off, ``ENABLED``."""
    return ENABLED and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and _hopper(device.index)


@functools.cache
def _hopper(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9

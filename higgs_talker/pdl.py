"""Programmatic dependent launch (PDL) for our Triton kernels on Hopper and later GPUs.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still running: its programs
become resident as that kernel's programs retire, and each waits (``gdc_wait``, PTX ``griddepcontrol.wait``) until
the previous kernel has completed and its writes are visible before it reads or writes anything. So a kernel's launch
and ramp hide behind the tail of the one before it. The previous kernel may let its dependents launch before it ends
(``gdc_launch_dependents``); ours do after their main loop. FlashInfer launches its kernels this way on Hopper; ours
(the one-row GEMV, the decode attention) do where ``enabled(device)`` holds. CUDA graphs keep the dependency.

The wait is the first thing such a kernel does, so it never reads a buffer the previous kernel is still writing, nor
writes one it is still reading. Off by default (``ENABLED``): it has been compiled for sm_90 and checked in the PTX,
not yet run on a GPU; ``bench_decode.py --pdl both`` measures it. Never under the Triton interpreter (which has no
``griddepcontrol``).
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = False  # on once a GPU run shows it correct and faster


def enabled(device: torch.device) -> bool:
    """Whether our kernels on ``device`` launch with PDL: a CUDA device of compute capability 9.0 or later, the
    interpreter off, ``ENABLED``."""
    return ENABLED and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and _hopper(device.index)


@functools.cache
def _hopper(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9

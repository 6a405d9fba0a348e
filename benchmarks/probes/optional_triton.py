"""Triton for the probes whose kernels are written in it: imported where installed; where it is not, the probe
still loads (``--help``) and ``require_triton`` ends it with one line instead of a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def jit(fn):
    """``triton.jit``, or ``fn`` unchanged where triton is missing (``require_triton`` stops before any launch)."""
    return fn if triton is None else triton.jit(fn)


def require_triton(script: str, interpreter_checks: bool = False) -> None:
    """Exit with one line where triton is missing; ``interpreter_checks``: the probe has CPU checks under
    ``TRITON_INTERPRET=1``, which need triton installed too."""
    if triton is None:
        how = " (for the checks on CPU under TRITON_INTERPRET=1: pip install triton into this environment)"
        sys.exit(f"{Path(script).name} needs triton, not installed here: it comes with CUDA builds of torch"
                 + (how if interpreter_checks else ""))  # fmt: skip

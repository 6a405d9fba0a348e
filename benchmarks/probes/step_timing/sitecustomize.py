"""Installs the step-timing probe (``higgs_step_timing``) in every Python process started with this folder on
``PYTHONPATH`` and ``HIGGS_STEP_TIMING_DIR`` set: Python imports ``sitecustomize`` at start-up, and the processes
vLLM / vllm-omni spawn inherit both variables. Without the variable it installs nothing.

    PYTHONPATH=$PWD/benchmarks/probes/step_timing:$PYTHONPATH HIGGS_STEP_TIMING_DIR=$OUT/steps python ...
    python benchmarks/probes/step_timing/summarize.py $OUT/steps

Being first on the path, this module hides any other ``sitecustomize`` (Debian's system Python has one, a
virtual environment may): that one is found on the rest of ``sys.path`` and run after the probe is installed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_hidden_sitecustomize() -> None:
    """Run the ``sitecustomize`` that this one hides on ``sys.path``, if there is one."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get("HIGGS_STEP_TIMING_DIR"):
    import higgs_step_timing

    higgs_step_timing.install(os.environ["HIGGS_STEP_TIMING_DIR"])
_run_hidden_sitecustomize()

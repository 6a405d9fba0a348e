"""Installs the step-timing probe (``higgs_step_timing``) in every Python process started with this folder on
``PYTHONPATH`` and ``HIGGS_STEP_TIMING_DIR`` set: Python imports ``sitecustomize`` at start-up, and the processes
vLLM / vllm-omni spawn inherit both variables. Without the variable it installs nothing.

    PYTHONPATH=$PWD/benchmarks/probes/step_timing:$PYTHONPATH HIGGS_STEP_TIMING_DIR=$OUT/steps python ...
    python benchmarks/probes/step_timing/summarize.py $OUT/steps

Being first on the path, this module hides any other ``sitecustomize`` (Debian's system Python has one, a
virtual environment may): that one is found on the rest of ``sys.path`` and run after the probe is installed.
"""

from __future__ import annotations

import os
import sys

_PROBES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _PROBES not in sys.path:
    sys.path.append(_PROBES)  # benchmarks/probes: after_import, which the probes share
import after_import  # noqa: E402

if os.environ.get("HIGGS_STEP_TIMING_DIR"):
    import higgs_step_timing

    higgs_step_timing.install(os.environ["HIGGS_STEP_TIMING_DIR"])
after_import.run_hidden_sitecustomize(__file__)

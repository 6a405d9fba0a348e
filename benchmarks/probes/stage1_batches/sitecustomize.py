"""Batches vllm-omni's Stage-1 codec decodes (``higgs_stage1_batches``) in every Python process started with this
folder on ``PYTHONPATH`` and ``HIGGS_STAGE1_BATCHES=1`` (the processes vllm-omni spawns inherit both). Without the
variable it changes nothing. An experiment for ``bench_omni.py``: at 64 streams vllm-omni 0.26's code2wav decodes
each request's chunk alone, one after another, and both talkers ended near the same audio seconds per second.

    PYTHONPATH=$PWD/benchmarks/probes/stage1_batches:$PYTHONPATH HIGGS_STAGE1_BATCHES=1 python ...

Being first on the path, this module hides any other ``sitecustomize`` (the step probe's, a system one): that one
is found on the rest of ``sys.path`` and run after this one.
"""

from __future__ import annotations

import os
import sys

_PROBES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _PROBES not in sys.path:
    sys.path.append(_PROBES)  # benchmarks/probes: after_import, which the probes share
import after_import  # noqa: E402

if os.environ.get("HIGGS_STAGE1_BATCHES") == "1":
    import higgs_stage1_batches

    higgs_stage1_batches.install()
after_import.run_hidden_sitecustomize(__file__)

"""Installs the score probe (``higgs_score_probe``) in every Python process started with this folder on
``PYTHONPATH`` and ``HIGGS_SCORE_PROBE_DIR`` set (the processes vLLM and vllm-omni spawn inherit both); without
the variable it installs nothing. Being first on the path, this module hides any other ``sitecustomize``: that one
(the step-timing probe's, a system one) is found on the rest of ``sys.path`` and run after."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# run once: another probe's sitecustomize that chains on may find this one again
_FIRST = not getattr(sys, "_higgs_score_probe_site", False)
sys._higgs_score_probe_site = True

if _FIRST and os.environ.get("HIGGS_SCORE_PROBE_DIR"):
    import higgs_score_probe

    higgs_score_probe.install(os.environ["HIGGS_SCORE_PROBE_DIR"])

_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if (
    _FIRST
    and _spec is not None
    and _spec.loader is not None
    and os.path.abspath(_spec.origin or "") != os.path.abspath(__file__)
):
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)

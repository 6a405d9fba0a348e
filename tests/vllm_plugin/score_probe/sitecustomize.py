"""Installs the score probe (``higgs_score_probe``) in every Python process started with this folder on
``PYTHONPATH`` and ``HIGGS_SCORE_PROBE_DIR`` set (the processes vLLM and vllm-omni spawn inherit both); without
the variable it installs nothing. Being first on the path, this module hides any other ``sitecustomize``: that one
(the step-timing probe's, a system one) is found on the rest of ``sys.path`` and run after."""

from __future__ import annotations

import os
import sys

_PROBES = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), *[os.pardir] * 3, "benchmarks",
                                        "probes"))  # fmt: skip
if _PROBES not in sys.path:
    sys.path.append(_PROBES)  # after_import, which the probes share
import after_import  # noqa: E402

if os.environ.get("HIGGS_SCORE_PROBE_DIR"):
    import higgs_score_probe

    higgs_score_probe.install(os.environ["HIGGS_SCORE_PROBE_DIR"])
after_import.run_hidden_sitecustomize(__file__)

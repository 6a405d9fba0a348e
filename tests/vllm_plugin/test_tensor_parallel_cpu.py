"""Tensor parallelism inside real vLLM on CPU: the tiny checkpoint served over two ranks (vLLM's CPU backend,
two worker processes), codes read from every rank through ``request_rows`` (``collective_rpc``).

The backbone is split across the ranks by vLLM's parallel layers; the codebook embedding/head are replicated and
every rank samples its own codes, so the ranks must agree row for row (``request_rows`` raises otherwise) - for
an unseeded request too, whose seed comes from vLLM's model seed on every rank - and the seeded and greedy rows
must equal the one-process direct engine's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config")

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _served import direct_rows, one_core_each, run_served  # noqa: E402

SCRIPT = Path(__file__).with_name("serve_tiny.py")
SPEC = [
    {"key": "greedy", "text": "Hello there, this prompt is long enough to be chunked.", "max_tokens": 40},
    {"key": "seeded", "text": "Hello there.", "temperature": 1.0, "seed": 3, "max_tokens": 30},
    {"key": "unseeded", "text": "Unseeded sampling here.", "temperature": 1.0, "max_tokens": 30},
    {"key": "topkp", "text": "Top k and top p.", "temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 7,
     "max_tokens": 30},
]  # fmt: skip


@pytest.fixture(scope="module")
def served_tp2(tiny_dir):
    bind = one_core_each(2)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "VLLM_CPU_OMP_THREADS_BIND": bind}  # fmt: skip
    kwargs = {"tensor_parallel_size": 2}
    return run_served([sys.executable, str(SCRIPT), str(tiny_dir), json.dumps(SPEC), "512", json.dumps(kwargs)], env)


def test_two_ranks_served_every_request_and_agreed(served_tp2):
    assert served_tp2["ranks"] == 2
    for r, spec in zip(served_tp2["results"], SPEC, strict=True):
        assert r["rows"], f"{r['key']}: no rows"
        assert len(r["rows"]) == spec["max_tokens"] or r["finish_reason"] == "stop", r["key"]


@pytest.mark.parametrize("key", ["greedy", "seeded", "topkp"])
def test_tensor_parallel_codes_equal_the_direct_engine(served_tp2, tiny_dir, key):
    spec = next(s for s in SPEC if s["key"] == key)
    got = next(r for r in served_tp2["results"] if r["key"] == key)
    assert torch.equal(torch.tensor(got["rows"], dtype=torch.long), direct_rows(tiny_dir, spec)), key

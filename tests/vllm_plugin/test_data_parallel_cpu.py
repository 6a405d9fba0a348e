"""Data parallelism inside real vLLM on CPU: the tiny checkpoint served by two independent engine processes
behind ``AsyncLLM`` (vLLM's CPU backend; a dense model's data-parallel ranks share nothing), rows read from
every engine through ``request_rows_async``.

Each request lives on one engine, so its rows must equal the one-process direct engine's (greedy, seeded,
top-k/top-p), every request must have rows on exactly one engine (``request_rows_async`` raises for two), and
both engines must have served some (vLLM balances the load).
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

SCRIPT = Path(__file__).with_name("serve_tiny_dp.py")
SPEC = [
    {"key": f"greedy{i}", "text": f"Request number {i} says hello.", "max_tokens": 24 + 2 * i} for i in range(4)
] + [
    {"key": "seeded", "text": "Hello there.", "temperature": 1.0, "seed": 3, "max_tokens": 30},
    {"key": "topkp", "text": "Top k and top p.", "temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 7,
     "max_tokens": 30},
]  # fmt: skip


@pytest.fixture(scope="module")
def served_dp2(tiny_dir):
    # one core per engine: vLLM's CPU backend takes data-parallel rank i's core from position i of the list
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": one_core_each(2)}
    return run_served([sys.executable, str(SCRIPT), str(tiny_dir), json.dumps(SPEC), "2"], env)


def test_both_engines_served_and_every_request_has_its_rows(served_dp2):
    engines = served_dp2["engines"]
    assert len(engines) == 2
    assert all(e["stats"]["sample_steps"] > 0 for e in engines), engines  # the load was spread
    for r, spec in zip(served_dp2["results"], SPEC, strict=True):
        stopped = r["finish_reason"] == "stop"  # the end-of-speech token carries no row
        assert r["rows"] and len(r["rows"]) == r["tokens"] - stopped, r["key"]  # one row per token, from one engine
        assert r["tokens"] == spec["max_tokens"] or stopped, r["key"]


@pytest.mark.parametrize("key", ["greedy0", "greedy3", "seeded", "topkp"])
def test_data_parallel_codes_equal_the_direct_engine(served_dp2, tiny_dir, key):
    spec = next(s for s in SPEC if s["key"] == key)
    got = next(r for r in served_dp2["results"] if r["key"] == key)
    assert torch.equal(torch.tensor(got["rows"], dtype=torch.long), direct_rows(tiny_dir, spec)), key

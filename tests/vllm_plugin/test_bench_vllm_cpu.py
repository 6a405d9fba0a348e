"""benchmarks/bench_vllm.py on vLLM's CPU backend (the tiny checkpoint): the worker process, the closed loop,
progress read from vLLM's outputs, the rows fetched from the worker and the JSON rows (a smoke test; its
numbers mean nothing)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config")

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vllm.py"


@pytest.mark.parametrize("dp", [1, 2])  # 1: vllm.LLM stepped by the closed loop; 2: AsyncLLM over two engines
def test_bench_vllm_runs_on_the_cpu_backend(tmp_path, dp):
    if dp > len(os.sched_getaffinity(0)):
        pytest.skip(f"{dp} CPU engines need {dp} cores")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, str(SCRIPT), "--cpu", "--profiles", "high_throughput", "--trtllm", "false",
           "--levels", "1,2", "--audio-s", "0.2,0.4", "--no-direct", "--worker-timeout", "500", "--dp", str(dp),
           "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=560, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    (path,) = tmp_path.glob("vllm_*.json")
    data = json.loads(path.read_text())
    rows = {(r["concurrency"], r["sampling"]): r for r in data["rows"]}  # the default --sampling deploy,greedy
    assert list(rows) == [(1, "deploy"), (1, "greedy"), (2, "deploy"), (2, "greedy")], data["rows"]
    assert data["meta"]["headline_sampling"] == "deploy"
    for r in rows.values():
        assert r["requests"] == 8 and r["rows_exact"], r  # every request produced exactly its forced rows
        assert 0 < r["ttfp_ms_p50"] <= r["ttfp_ms_p90"] and r["rtf_p50"] > 0 and r["audio_s_per_s"] > 0, r
        assert r["tensor_parallel_size"] == 1 and r["data_parallel_size"] == dp, r
        assert r["profile"] == "high_throughput", r
    name = "high_throughput_trtllm-false" + (f"_dp{dp}" if dp > 1 else "")
    stats = data["meta"]["adapter_stats"][name]
    assert stats["sample_steps"] > 0 and stats["text_head_skipped"] > 0, stats
    assert Path(tmp_path, f"{path.stem}_{name}.log").is_file()

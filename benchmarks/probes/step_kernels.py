"""Whole decode step in full-decode graphs with the decode kernel forced to native, to XQA, and measured (auto).

CUDA only (not part of the CPU smoke tests). 4B shape, random bf16 weights, buckets 1/16/64, 512-token
prompts; per batch: the median of 20 ``engine.step()`` calls (CUDA events; host wall beside it) and of 20
bare replays of the bucket's graph. Prints lines; the H200 output of 2026-11-30 is
``benchmarks/results/h200_20261130/step_kernels.log``.

    python benchmarks/probes/step_kernels.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode import SHAPE_4B, make_prompt, suppress_eoc  # noqa: E402

from higgs_talker import HiggsTalker, SamplingParams, TalkerConfig, TextConfig  # noqa: E402


def median_ms(fn, n: int = 20) -> tuple[float, float]:
    """Median (CUDA-event ms, host wall ms) of ``n`` calls, each from an idle device."""
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append((start.elapsed_time(end), (time.perf_counter() - t0) * 1e3))
    times.sort()
    return times[n // 2]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe (FlashInfer, CUDA graphs): no CUDA device here")
    torch.set_grad_enabled(False)
    cfg = TalkerConfig(text=TextConfig(**SHAPE_4B))
    for kernel in ("native", "xqa", "auto"):
        t0 = time.perf_counter()
        talker = HiggsTalker.from_config(
            cfg,
            device="cuda",
            dtype="bfloat16",
            graph_mode="full_decode",
            decode_kernel=kernel,
            buckets=[1, 16, 64],
            max_num_seqs=64,
            num_blocks=64 * 40 + 64,
            max_model_len=4096,
        )
        suppress_eoc(talker)
        eng = talker.engine
        chosen = eng.runner.attn.bucket_kernel
        print(f"{kernel}: built+warm {time.perf_counter() - t0:.1f}s chosen={chosen}", flush=True)
        for b in (1, 16, 64):
            params = SamplingParams(temperature=0.0, max_frames=400)
            ids = [eng.add_request(make_prompt(talker, 512, seed=i), params) for i in range(b)]
            while any(not eng.requests[i].rows for i in ids):
                eng.step()
            for _ in range(5):
                eng.step()
            step_ms, host_ms = median_ms(eng.step)
            replay_ms, _ = median_ms(eng.graphs.full.graphs[b].graph.replay)
            print(
                f"  {kernel} b={b} ctx=512: step {step_ms:.3f} ms (host wall {host_ms:.3f}), "
                f"replay only {replay_ms:.3f} ms",
                flush=True,
            )
            for i in ids:
                eng.cancel(i)
                eng.requests.pop(i, None)
        del talker, eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Where a prefill step's time goes, and what the first frame waits for (TTFP).

CUDA only. 4B shape, random bf16 weights, graph mode ``auto``, with prefill graphs (``graphs``:
``PREFILL_BUCKETS``) and without (``unpadded``: eager prefills, the default). For prompts of 32, 128 and
512 tokens (one request): the prefill ``engine.step()`` timed on the host and with CUDA events (median of 5),
beside the kernel time inside it that torch.profiler sums (their gap is the GPU waiting for the host); then one
request from submission to its 8th row (the first complete frame), split into the prefill and the decode steps
after it (the engine's default scheduling: on CUDA the first decode is queued behind the prefill); then a
cProfile of one 128-token prefill (the host functions that take the time).

    python benchmarks/probes/profile_prefill.py [--variants graphs,unpadded]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode import SHAPE_4B, make_prompt, suppress_eoc  # noqa: E402

from higgs_talker import HiggsTalker, SamplingParams, TalkerConfig, TextConfig  # noqa: E402
from higgs_talker.cuda_graphs import PREFILL_BUCKETS  # noqa: E402


def prefill_once(talker: HiggsTalker, prompt) -> tuple[float, float]:
    """(host ms, CUDA-event ms) of one prefill step of ``prompt`` alone (no decode queued behind it: synchronous
    scheduling for this step); the request is cancelled after."""
    eng = talker.engine
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_frames=50))
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    was, eng.async_scheduling = eng.async_scheduling, False
    t0 = time.perf_counter()
    start.record()
    eng.step()
    end.record()
    host = (time.perf_counter() - t0) * 1e3
    eng.async_scheduling = was
    end.synchronize()
    assert eng.requests[rid].rows, "the step was not this request's prefill"
    eng.cancel(rid)
    eng.requests.pop(rid)
    return host, start.elapsed_time(end)


def kernel_ms(talker: HiggsTalker, prompt) -> float:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill_once(talker, prompt)
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def first_frame(talker: HiggsTalker, prompt) -> str:
    eng = talker.engine
    t0 = time.perf_counter()
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_frames=50))
    marks = []
    while len(eng.requests[rid].rows) < talker.cfg.num_codebooks:
        eng.step()
        marks.append((time.perf_counter() - t0) * 1e3)
    eng.cancel(rid)
    eng.requests.pop(rid)
    steps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    each = statistics.median(steps) if steps else float("nan")
    return (
        f"prefill {marks[0]:.1f} ms, then {len(steps)} decode steps {sum(steps):.1f} ms ({each:.2f} each): "
        f"{talker.cfg.num_codebooks} rows at {marks[-1]:.1f} ms"
    )


VARIANTS = {"graphs": PREFILL_BUCKETS, "unpadded": ()}  # name -> prefill_buckets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="graphs,unpadded", help=f"comma list of {', '.join(VARIANTS)}")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        sys.exit(f"--variants: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe: no CUDA device here")
    torch.set_grad_enabled(False)
    for name in names:
        profile_variant(name, VARIANTS[name])
        gc.collect()
        torch.cuda.empty_cache()


def profile_variant(name: str, prefill_buckets) -> None:
    cfg = TalkerConfig(text=TextConfig(**SHAPE_4B))
    t0 = time.perf_counter()
    talker = HiggsTalker.from_config(
        cfg, device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=4096, prefill_buckets=prefill_buckets
    )
    suppress_eoc(talker)
    print(f"== {name}: built auto in {time.perf_counter() - t0:.1f} s "
          f"(graph warm-up {talker.engine.graphs.warmup_s:.1f} s)", flush=True)  # fmt: skip
    for n in (32, 128, 512):
        prompt = make_prompt(talker, n, seed=n)
        prefill_once(talker, prompt)  # first use of this shape
        runs = sorted(prefill_once(talker, prompt) for _ in range(5))
        host, gpu = runs[2]
        print(f"prefill {len(prompt):4d} tokens: host {host:.1f} ms, CUDA events {gpu:.1f} ms, "
              f"kernels {kernel_ms(talker, prompt):.1f} ms", flush=True)  # fmt: skip
        print(f"  first frame ({len(prompt)} tokens): {first_frame(talker, prompt)}", flush=True)
    prompt = make_prompt(talker, 128, seed=128)
    prof = cProfile.Profile()
    prof.enable()
    prefill_once(talker, prompt)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())


if __name__ == "__main__":
    main()

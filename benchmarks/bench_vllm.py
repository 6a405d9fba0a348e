"""The talker inside vLLM: TTFP, RTF and audio seconds per second per deploy profile, attention route and
concurrency, with our direct engine at the same concurrency levels in the same run.

Each (profile, use_trtllm_attention) pair runs in its own process (a clean GPU): ``vllm.LLM`` with stage 0 of
the packaged deploy YAML as written (``high_throughput``: enforce_eager, our local MLP graphs on;
``low_latency``: vLLM's FULL_DECODE_ONLY graphs, our local path off) plus the text-only bridge, on a 4B-shaped
checkpoint with random bf16 weights (written once; codebook 0's EOC row zeroed as in bench_decode). Lengths
are forced: ``min_tokens = max_tokens`` = the rows of a 4-8 s utterance, so every request produces exactly
its rows. Per concurrency level C a closed loop keeps C requests in flight over max(2C, 8) requests
(prompts 30-200 tokens); a request's TTFP is submit -> the step after which its first frame is final (C + 1
rows), its RTF is submit -> finish over its audio seconds. Each level runs once per ``--sampling`` name (default
``deploy,greedy``: the deploy profiles' temperature 1.0, top_p 0.95, top_k 50 with seeded requests, the
headline, then the argmax), on the same engine; the rows say which (``sampling``). Data parallel (``--dp``): an
``AsyncLLM`` over that many engines with C clients, each sending its next request when its last one finished.

    python benchmarks/bench_vllm.py --out $OUT                       # both profiles x both routes x 1,4,16,64
    python benchmarks/bench_vllm.py --profiles high_throughput --trtllm false --levels 1,4 --no-direct
    python benchmarks/bench_vllm.py --tp 1,2 --levels 16,64 --no-direct     # two GPUs: tensor parallel vs one
    python benchmarks/bench_vllm.py --dp 1,2 --levels 16,64 --no-direct     # two GPUs: two engines (AsyncLLM) vs one
    python benchmarks/bench_vllm.py --cpu --tp 1,2 --profiles high_throughput --trtllm false --levels 1,2 \
        --audio-s 0.2,0.4 --no-direct                                      # smoke test on vLLM's CPU backend
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import string
import subprocess
import sys
import time
from pathlib import Path

from common import (
    SAMPLINGS,
    ResultFile,
    add_sampling_option,
    environment,
    floats_arg,
    ints_arg,
    log,
    package_version,
    percentile,
    print_table,
    strs_arg,
)

PROFILES = ("high_throughput", "low_latency")
CUDA_ONLY = ("attention_backend", "attention_config", "compilation_config", "gpu_memory_utilization")
LEVELS = (1, 4, 16, 64)
SHAPE_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                rope_theta=1_000_000.0)  # fmt: skip


def write_random_checkpoint(path: Path, seed: int = 0) -> Path:
    """A 4B-shaped checkpoint with random bf16 weights drawn on the GPU (norms 1, std 0.02; the device memory is
    given back), the tiny tokenizer (its vocabulary fits the 4B one), and codebook 0's EOC row zeroed so greedy never
    ends a stream early."""
    import torch

    from higgs_talker.checkpoint import expected_shapes, save_checkpoint
    from higgs_talker.config import TalkerConfig, TextConfig
    from higgs_talker.tiny import write_tokenizer

    if (path / "config.json").is_file():
        return path
    cfg = TalkerConfig(text=TextConfig(**SHAPE_4B), eos_token_id=256)
    g = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {}
    for key, shape in expected_shapes(cfg).items():
        if key.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
        else:
            t = (torch.randn(shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        if key == "tied.embedding.modality_embeddings.0.embedding.weight":
            t[cfg.eoc_id].zero_()
        tensors[key] = t.cpu()
    del t
    # the allocator would keep the draws' ~4 GB, which an engine built next in this process (its KV cache sized from
    # the free memory) or in another would not get
    torch.cuda.empty_cache()
    path.mkdir(parents=True, exist_ok=True)
    save_checkpoint(tensors, path, shards=4)
    write_tokenizer(path, cfg.text.vocab_size)
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2), encoding="utf-8")
    return path


def stage0_engine_args(profile: str, use_trtllm: bool) -> dict:
    """Stage 0 of the packaged deploy YAML as vllm.LLM keyword arguments (the keys vLLM's engine takes), on vLLM's
    synchronous scheduler as every run on record: the low-latency YAML's ``async_scheduling`` (vllm-omni's Stage 0
    with our hand-over) stays out, as do its vllm-omni keys; the text-only bridge has not run under vLLM's
    asynchronous scheduling."""
    from bench_omni import stage_of

    from higgs_talker.vllm_plugin.deploy import deploy_config_path

    stage = stage_of(deploy_config_path(profile), 0)
    keys = ("max_num_seqs", "gpu_memory_utilization", "enforce_eager", "compilation_config", "attention_backend",
            "enable_prefix_caching", "max_num_batched_tokens", "max_model_len")  # fmt: skip
    args = {k: stage[k] for k in keys if k in stage}
    args["attention_config"] = {**stage.get("attention_config", {}), "use_trtllm_attention": use_trtllm}
    return args


def jobs(n: int, seed: int, audio_s: tuple[float, float] = (4.0, 8.0), frame_rate: int = 25,
         codebooks: int = 8) -> list[tuple[str, int, int]]:  # fmt: skip
    """(text, prompt-length hint, rows) per request: prompts of 30-200 tokens, ``audio_s`` seconds of audio."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(27, 197)))
        frames = max(1, round(rng.uniform(*audio_s) * frame_rate))
        out.append((text, len(text) + 3, frames + codebooks))
    return out


def run_level(
    llm, tok, cfg, level: int, seed: int, audio_s: tuple[float, float], sampling: str
) -> tuple[list[dict], float]:
    """A closed loop of ``level`` requests in flight over max(2 * level, 8) requests sampled as ``sampling``
    -> (records, wall s).

    Every step of a bridge request yields one token and one delayed row, so progress is read from vLLM's own
    outputs (token counts), whatever process the adapter runs in; the rows are fetched once at the end
    (``request_rows``, outside the timing) to check every request produced exactly its rows."""
    from higgs_talker.vllm_plugin.bridge import request_rows

    engine = llm.llm_engine
    todo, live, records = jobs(max(2 * level, 8), seed, audio_s, cfg.frame_rate, cfg.num_codebooks), {}, {}
    first_frame = cfg.num_codebooks + 1  # rows (= tokens) after which a request's first frame is final

    def submit(k: int) -> None:
        text, _, rows = todo.pop(0)
        key = f"L{level}-{sampling}-{k}"
        live[key] = {"t": time.perf_counter(), "want_rows": rows, "tokens": 0}
        prompt = {"prompt_token_ids": tok.build(text).input_ids.tolist()}
        engine.add_request(key, prompt, request_params(key, rows, sampling, seed + k))

    wall0, submitted = time.perf_counter(), 0
    for _ in range(min(level, len(todo))):
        submit(submitted)
        submitted += 1
    while live:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            rec = live.get(o.request_id)
            if rec is None:
                continue
            rec["tokens"] += len(o.outputs[0].token_ids)
            if "ttfp" not in rec and rec["tokens"] >= first_frame:
                rec["ttfp"] = now - rec["t"]
            if o.finished:
                live.pop(o.request_id)
                rec["done"] = now
                records[o.request_id] = rec
                if todo:
                    submit(submitted)
                    submitted += 1
    wall = time.perf_counter() - wall0
    rows = request_rows(llm, list(records))  # every worker's rows (they must agree), after the timing
    return summarise(records, rows, cfg), wall


def request_params(key: str, rows: int, sampling: str, seed: int):
    """``sampling`` (a name in SAMPLINGS; sampled ones seeded with ``seed``), exactly ``rows`` tokens (= rows),
    streamed as deltas, through the bridge under ``key``."""
    import vllm
    from vllm.sampling_params import RequestOutputKind

    chosen = dict(SAMPLINGS[sampling]) | ({"seed": seed} if SAMPLINGS[sampling].get("temperature") else {})
    return vllm.SamplingParams(**chosen, max_tokens=rows, min_tokens=rows, detokenize=False,
                               output_kind=RequestOutputKind.DELTA, extra_args={"higgs_request_key": key})  # fmt: skip


def summarise(records: dict[str, dict], rows: dict, cfg) -> list[dict]:
    """Per request: TTFP, RTF and audio seconds from its timestamps and the rows its engine holds."""
    out = []
    for key, rec in records.items():
        got = rows[key]
        n = 0 if got is None else int(got.shape[0])
        audio = max(n - cfg.num_codebooks, 1) / cfg.frame_rate
        out.append({"ttfp_ms": rec.get("ttfp", rec["done"] - rec["t"]) * 1e3, "rtf": (rec["done"] - rec["t"]) / audio,
                    "audio_s": audio, "rows": n, "tokens": rec["tokens"], "want_rows": rec["want_rows"]})  # fmt: skip
    return out


async def run_level_async(engine, tok, cfg, level: int, seed: int, audio_s, sampling: str) -> tuple[list[dict], float]:
    """``run_level`` for an ``AsyncLLM`` (data parallel: vLLM spreads the requests over its engines): ``level``
    clients, each sending its next request when the last one finished."""
    import asyncio

    from higgs_talker.vllm_plugin.bridge import request_rows_async

    todo, records = jobs(max(2 * level, 8), seed, audio_s, cfg.frame_rate, cfg.num_codebooks), {}
    first_frame = cfg.num_codebooks + 1
    numbers = iter(range(len(todo)))

    async def client() -> None:
        while todo:
            text, _, rows = todo.pop(0)
            number = next(numbers)
            key = f"L{level}-{sampling}-{number}"
            rec = records[key] = {"t": time.perf_counter(), "want_rows": rows, "tokens": 0}
            prompt = {"prompt_token_ids": tok.build(text).input_ids.tolist()}
            async for o in engine.generate(prompt, request_params(key, rows, sampling, seed + number), key):
                rec["tokens"] += len(o.outputs[0].token_ids)
                if "ttfp" not in rec and rec["tokens"] >= first_frame:
                    rec["ttfp"] = time.perf_counter() - rec["t"]
            rec["done"] = time.perf_counter()

    wall0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(level)))
    wall = time.perf_counter() - wall0
    return summarise(records, await request_rows_async(engine, list(records)), cfg), wall


def worker(args: argparse.Namespace) -> None:
    """One (profile, route, tensor-parallel size, data-parallel size) configuration in this process; prints a
    RESULT: JSON line of rows after each level. Data parallel: an ``AsyncLLM`` over that many engines (vLLM runs
    a dense model's data-parallel ranks as independent engines; offline ``vllm.LLM`` refuses them)."""
    tp, dp = args.tp[0], args.dp[0]
    # one GPU: the engine in this process; tensor or data parallel: vLLM's worker / engine processes
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if tp * dp == 1 else "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from higgs_talker.config import TalkerConfig
    from higgs_talker.prompt import TalkerTokenizer
    from higgs_talker.vllm_plugin import TEXT_ONLY_BRIDGE
    from higgs_talker.vllm_plugin.bridge import ROWS_EXTENSION

    ckpt = args.model
    cfg = TalkerConfig.from_pretrained(ckpt)
    tok = TalkerTokenizer.from_pretrained(ckpt, cfg)
    use_trtllm = args.trtllm[0] == "true"
    engine_args = stage0_engine_args(args.profiles[0], use_trtllm)
    if args.cpu:  # the vLLM CPU backend (smoke test): no FlashInfer, no CUDA graphs, fp32
        engine_args = {k: v for k, v in engine_args.items() if k not in CUDA_ONLY} | {
            "dtype": "float32",
            "max_model_len": 1024,
        }
    else:
        engine_args |= {"dtype": "bfloat16", "kernel_config": {"enable_flashinfer_autotune": False}}
    if tp > 1:
        engine_args["tensor_parallel_size"] = tp
    engine_args |= {"model": ckpt, "logits_processors": [TEXT_ONLY_BRIDGE], "worker_extension_cls": ROWS_EXTENSION}
    base = {"profile": args.profiles[0], "use_trtllm_attention": use_trtllm, "tensor_parallel_size": tp,
            "data_parallel_size": dp}  # fmt: skip
    if dp == 1:
        import vllm

        t0 = time.perf_counter()
        llm = vllm.LLM(**engine_args)
        start_s = time.perf_counter() - t0
        rows_out = []
        for level in args.levels:
            for sampling in args.sampling:
                records, wall = run_level(llm, tok, cfg, level, args.seed + level, tuple(args.audio_s), sampling)
                rows_out.append(level_row(base | {"sampling": sampling}, start_s, level, records, wall))
                print_result(rows_out, llm.collective_rpc("higgs_adapter_report")[0])  # rank 0's adapter
        return
    import asyncio

    asyncio.run(async_worker(args, base, engine_args | {"data_parallel_size": dp}, tok, cfg))


async def async_worker(args: argparse.Namespace, base: dict, engine_args: dict, tok, cfg) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from higgs_talker.vllm_plugin.compat import collective_rpc_every_engine

    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    start_s = time.perf_counter() - t0
    try:
        rows_out = []
        for level in args.levels:
            for sampling in args.sampling:
                records, wall = await run_level_async(engine, tok, cfg, level, args.seed + level, tuple(args.audio_s),
                                                      sampling)  # fmt: skip
                rows_out.append(level_row(base | {"sampling": sampling}, start_s, level, records, wall))
                reports = await collective_rpc_every_engine(engine, "higgs_adapter_report")
                print_result(rows_out, reports[0][0])  # engine 0, rank 0
    finally:
        engine.shutdown()


def level_row(base: dict, start_s: float, level: int, records: list[dict], wall: float) -> dict:
    """The JSON row of one concurrency level (logged)."""
    row = base | {"concurrency": level, "requests": len(records), "start_s": start_s, "wall_s": wall,
                  "audio_s_per_s": sum(r["audio_s"] for r in records) / wall,
                  "rows_exact": all(r["rows"] == r["want_rows"] == r["tokens"] for r in records)}  # fmt: skip
    for m in ("ttfp_ms", "rtf"):
        for q in (50, 90):
            row[f"{m}_p{q}"] = percentile([r[m] for r in records], q)
    log(f"{row['profile']} {row['sampling']} trtllm={row['use_trtllm_attention']} tp={row['tensor_parallel_size']} "
        f"dp={row['data_parallel_size']} C={level}: TTFP p50 {row['ttfp_ms_p50']:.1f} ms, RTF p50 "
        f"{row['rtf_p50']:.3f}, {row['audio_s_per_s']:.1f} audio s/s")  # fmt: skip
    return row


def print_result(rows_out: list[dict], report: dict) -> None:
    """The RESULT: line after each level (the levels done before a timeout count), with one adapter's counters."""
    stats = dict(report["stats"], local_mlp_replays=report["local_mlp"]["replays"],
                 decision=report["graph_decision"])  # fmt: skip
    print("RESULT:" + json.dumps({"rows": rows_out, "stats": stats}), flush=True)


def failure_line(text: str) -> str:
    """The cause of a failed process in one line: the last exception its output names, else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    found = [ln for ln in lines if re.search(r"\b\w*(Error|Exception|Exit)\b: ", ln)]
    return (found or lines or ["no output"])[-1][:300]


def direct_rows(args: argparse.Namespace, out_dir: Path) -> list[dict]:
    """Our direct engine (auto graphs; eager under --cpu) at the same levels, prompts and lengths: bench_e2e.py in a
    subprocess."""
    mode = "eager" if args.cpu else "auto"
    out = out_dir / "direct_e2e"
    levels = ",".join(map(str, args.levels))
    script = str(Path(__file__).with_name("bench_e2e.py"))
    cmd = [sys.executable, script, "--model", args.model, "--modes", mode, "--levels", levels,
           "--audio-s", ",".join(map(str, args.audio_s)), "--prompt-tokens", "30,200",
           "--sampling", ",".join(args.sampling), "--out", str(out)]  # fmt: skip
    if args.cpu:
        cmd += ["--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
    files = sorted(out.glob("e2e_*.json"))
    if proc.returncode or not files:
        error = failure_line(proc.stderr)
        log(f"direct engine run failed: {error}")
        return [{"profile": f"direct_{mode}", "use_trtllm_attention": None, "status": "error", "error": error}]
    rows = []
    for r in json.loads(files[-1].read_text())["rows"]:
        if r.get("status") == "ok":
            rows.append({"profile": f"direct_{mode}", "sampling": r["sampling"], "use_trtllm_attention": None,
                         "concurrency": r["concurrency"],
                         "ttfp_ms_p50": r["ttfp_ms_p50"], "ttfp_ms_p90": r["ttfp_ms_p90"], "rtf_p50": r["rtf_p50"],
                         "rtf_p90": r["rtf_p90"], "audio_s_per_s": r["audio_s_per_s"]})  # fmt: skip
    return rows


def plot(path: Path, rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    series: dict[str, list[dict]] = {}
    for r in rows:
        name = r["profile"] + f" {r.get('sampling', 'greedy')}"
        name += "" if r["use_trtllm_attention"] is None else f" trtllm={r['use_trtllm_attention']}"
        name += f" tp={r['tensor_parallel_size']}" if r.get("tensor_parallel_size", 1) > 1 else ""
        name += f" dp={r['data_parallel_size']}" if r.get("data_parallel_size", 1) > 1 else ""
        series.setdefault(name, []).append(r)
    metrics = (("ttfp_ms_p50", "TTFP p50 (ms)"), ("rtf_p50", "RTF p50"), ("audio_s_per_s", "audio s per s"))
    for ax, (metric, label) in zip(axes, metrics, strict=True):
        for name, rs in series.items():
            rs = sorted(rs, key=lambda r: r["concurrency"])
            ax.plot([r["concurrency"] for r in rs], [r[metric] for r in rs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(label)
    axes[0].set_yscale("log")  # queued requests (concurrency above max_num_seqs) wait seconds
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main(argv: list[str] | None = None) -> ResultFile | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", type=strs_arg, default=list(PROFILES))
    p.add_argument("--trtllm", type=strs_arg, default=["false", "true"], help="use_trtllm_attention values")
    p.add_argument("--tp", type=ints_arg, default=[1], help="tensor-parallel sizes (one worker each)")
    p.add_argument("--dp", type=ints_arg, default=[1], help="data-parallel sizes (AsyncLLM engines; one worker each)")
    p.add_argument("--levels", type=ints_arg, default=list(LEVELS))
    add_sampling_option(p, "level")
    p.add_argument("--audio-s", type=floats_arg, default=[4.0, 8.0], help="min,max seconds of audio per request")
    p.add_argument("--model", default=None, help="checkpoint directory (default: a random 4B-shaped one)")
    p.add_argument("--ckpt-dir", default="/tmp/higgs_4b_random", help="where the random checkpoint is written")
    p.add_argument("--cpu", action="store_true", help="vLLM's CPU backend on the tiny checkpoint (smoke test)")
    p.add_argument("--no-direct", action="store_true", help="skip our direct engine's rows")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-timeout", type=int, default=600, help="s per worker process, JIT included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if len(args.audio_s) != 2 or not 0 < args.audio_s[0] <= args.audio_s[1]:
        p.error(f"--audio-s takes min,max seconds with 0 < min <= max, got {args.audio_s}")
    if args.worker:
        worker(args)
        return None
    import torch

    if args.cpu:
        from higgs_talker.tiny import tiny_checkpoint

        args.model = args.model or str(tiny_checkpoint())
    args.model = args.model or str(write_random_checkpoint(Path(args.ckpt_dir)))
    meta = environment(torch.device("cpu" if args.cpu else "cuda"), "bench_vllm.py", argv) | {
        "vllm": package_version("vllm"), "vllm_omni": package_version("vllm_omni"),
        "flashinfer": package_version("flashinfer"), "model": args.model,
        "progress": "TTFP and RTF from vLLM's per-step outputs (one token = one row); rows checked afterwards",
        "samplings": {s: SAMPLINGS[s] for s in args.sampling}, "headline_sampling": args.sampling[0],
    }  # fmt: skip
    writer = ResultFile(args.out, "vllm_multigpu" if max(args.tp) * max(args.dp) > 1 else "vllm", meta, smoke=args.cpu)
    stats, failed = {}, []
    configs = [(p_, r_, t_, d_) for p_ in args.profiles for r_ in args.trtllm for t_ in args.tp for d_ in args.dp]
    for profile, route, tp, dp in configs:
        name = f"{profile}_trtllm-{route}" + (f"_tp{tp}" if tp > 1 else "") + (f"_dp{dp}" if dp > 1 else "")
        cmd = [sys.executable, __file__, "--worker", "--profiles", profile, "--trtllm", route, "--tp", str(tp),
               "--dp", str(dp), "--model", args.model, "--levels", ",".join(map(str, args.levels)),
               "--seed", str(args.seed), "--audio-s", ",".join(map(str, args.audio_s)),
               "--sampling", ",".join(args.sampling)] + (["--cpu"] if args.cpu
                                                                                          else [])  # fmt: skip
        env = dict(os.environ)
        if args.cpu and tp * dp > 1:  # one core per CPU rank or engine: vLLM cannot pick them on one NUMA node
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, sorted(os.sched_getaffinity(0))[: tp * dp])))
        # the worker's own log (vLLM's start-up, JIT, our graph decision) lies beside the JSON
        log_path = writer.path.with_name(f"{writer.path.stem}_{name}.log")
        t0, error = time.perf_counter(), None
        with open(log_path, "w", encoding="utf-8") as sink:
            try:
                proc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, timeout=args.worker_timeout, env=env)
                error = f"worker exited with status {proc.returncode}" if proc.returncode else None
            except subprocess.TimeoutExpired as exc:
                error = f"timed out after {exc.timeout} s"
        text = log_path.read_text(encoding="utf-8", errors="replace")
        lines = [x for x in text.splitlines() if x.startswith("RESULT:")]
        if lines:  # the levels finished before a timeout still count
            result = json.loads(lines[-1][len("RESULT:") :])
            for row in result["rows"]:
                writer.add(row)
            stats[name] = result["stats"]
        if error or not lines:
            error = f"{error or 'no result'}: {failure_line(text)}"
            failed += [] if lines else [f"{name}: {error}"]
            writer.add({"profile": profile, "use_trtllm_attention": route == "true", "tensor_parallel_size": tp,
                        "data_parallel_size": dp, "status": "error", "error": error,
                        "log_tail": text[-3000:]})  # fmt: skip
        log(f"{name}: {time.perf_counter() - t0:.0f} s" + (f", failed: {error} (log {log_path})" if error else ""))
    writer.meta["adapter_stats"] = stats
    writer.save()
    if len(failed) == len(configs):  # no rows at all, and nothing to set the direct engine beside
        if not args.no_direct:
            writer.add({"profile": "direct", "status": "skipped", "error": "every vLLM worker failed"})
        raise SystemExit(f"bench_vllm.py: every vLLM worker failed, the first {failed[0]}; see {writer.path}")
    if not args.no_direct:
        for row in direct_rows(args, writer.dir):
            writer.add(row)
    cols = ["profile", "sampling", "use_trtllm_attention", "tensor_parallel_size", "data_parallel_size", "concurrency",
            "ttfp_ms_p50", "ttfp_ms_p90", "rtf_p50", "rtf_p90", "audio_s_per_s"]  # fmt: skip
    done = [r for r in writer.rows if "concurrency" in r]
    print_table(done, cols, "vLLM deploy profiles")
    plot(writer.path, done)
    return writer


if __name__ == "__main__":
    main()

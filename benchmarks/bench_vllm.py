"""The talker inside vLLM: TTFP, RTF and audio seconds per second per deploy profile, attention route and
concurrency, with our direct engine at the same concurrency levels in the same run.

Each (profile, use_trtllm_attention) pair runs in its own process (a clean GPU): ``vllm.LLM`` with stage 0 of
the packaged deploy YAML as written (``high_throughput``: enforce_eager, our local MLP graphs on;
``low_latency``: vLLM's FULL_DECODE_ONLY graphs, our local path off) plus the text-only bridge, on a 4B-shaped
checkpoint with random bf16 weights (written once; codebook 0's EOC row zeroed as in bench_decode). Lengths
are forced: ``min_tokens = max_tokens`` = the rows of a 4-8 s utterance, so every request produces exactly
its rows. Per concurrency level C a closed loop keeps C requests in flight over max(2C, 8) requests
(prompts 30-200 tokens); a request's TTFP is submit -> the step after which its first frame is final (C + 1
rows), its RTF is submit -> finish over its audio seconds.

    python benchmarks/bench_vllm.py --out $OUT                       # both profiles x both routes x 1,4,16,64
    python benchmarks/bench_vllm.py --profiles high_throughput --trtllm false --levels 1,4 --no-direct
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import subprocess
import sys
import time
from pathlib import Path

from common import ResultFile, environment, ints_arg, log, package_version, percentile, print_table, strs_arg

PROFILES = ("high_throughput", "low_latency")
LEVELS = (1, 4, 16, 64)
SHAPE_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                rope_theta=1_000_000.0)  # fmt: skip


def write_random_checkpoint(path: Path, seed: int = 0) -> Path:
    """A 4B-shaped checkpoint with random bf16 weights drawn on the GPU (norms 1, std 0.02), the tiny tokenizer
    (its vocabulary fits the 4B one), and codebook 0's EOC row zeroed so greedy never ends a stream early."""
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
    path.mkdir(parents=True, exist_ok=True)
    save_checkpoint(tensors, path, shards=4)
    write_tokenizer(path, cfg.text.vocab_size)
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2), encoding="utf-8")
    return path


def stage0_engine_args(profile: str, use_trtllm: bool) -> dict:
    """Stage 0 of the packaged deploy YAML as vllm.LLM keyword arguments (the keys vLLM's engine takes)."""
    import yaml

    from higgs_talker.vllm_plugin.deploy import deploy_config_path

    stage = yaml.safe_load(deploy_config_path(profile).read_text())["stages"][0]
    keys = ("max_num_seqs", "gpu_memory_utilization", "enforce_eager", "compilation_config", "attention_backend",
            "enable_prefix_caching", "async_scheduling", "max_num_batched_tokens", "max_model_len")  # fmt: skip
    args = {k: stage[k] for k in keys if k in stage}
    args["attention_config"] = {**stage.get("attention_config", {}), "use_trtllm_attention": use_trtllm}
    return args


def jobs(n: int, seed: int, frame_rate: int = 25, codebooks: int = 8) -> list[tuple[str, int, int]]:
    """(text, prompt-length hint, rows) per request: prompts of 30-200 tokens, 4-8 s of audio."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(27, 197)))
        frames = round(rng.uniform(4.0, 8.0) * frame_rate)
        out.append((text, len(text) + 3, frames + codebooks))
    return out


def run_level(engine, talker, tok, cfg, level: int, seed: int) -> tuple[list[dict], float]:
    """A closed loop of ``level`` requests in flight over max(2 * level, 8) requests -> (records, wall s)."""
    import vllm

    todo, live, records = jobs(max(2 * level, 8), seed), {}, []
    first_frame = cfg.num_codebooks + 1  # rows after which a request's first frame is final

    def submit(k: int) -> None:
        text, _, rows = todo.pop(0)
        key = f"L{level}-{k}"
        sp = vllm.SamplingParams(temperature=0.0, max_tokens=rows, min_tokens=rows, detokenize=False,
                                 extra_args={"higgs_request_key": key})  # fmt: skip
        live[key] = {"t": time.perf_counter(), "rows": rows}
        engine.add_request(key, {"prompt_token_ids": tok.build(text).input_ids.tolist()}, sp)

    wall0, submitted = time.perf_counter(), 0
    for _ in range(min(level, len(todo))):
        submit(submitted)
        submitted += 1
    while live:
        outs = engine.step()
        now = time.perf_counter()
        for key, rec in live.items():
            got = talker.request_rows(key) if "ttfp" not in rec else None
            if got is not None and got.shape[0] >= first_frame:
                rec["ttfp"] = now - rec["t"]
        for o in outs:
            if o.finished and o.request_id in live:
                rec = live.pop(o.request_id)
                rows = talker.request_rows(o.request_id)
                audio_s = (rows.shape[0] - cfg.num_codebooks) / cfg.frame_rate
                records.append({"ttfp_ms": rec.get("ttfp", now - rec["t"]) * 1e3, "rtf": (now - rec["t"]) / audio_s,
                                "audio_s": audio_s, "rows": int(rows.shape[0]), "want_rows": rec["rows"]})  # fmt: skip
                if todo:
                    submit(submitted)
                    submitted += 1
    return records, time.perf_counter() - wall0


def worker(args: argparse.Namespace) -> None:
    """One (profile, route) configuration in this process; prints one RESULT: JSON line of rows."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import vllm

    from higgs_talker.config import TalkerConfig
    from higgs_talker.prompt import TalkerTokenizer
    from higgs_talker.vllm_plugin import TEXT_ONLY_BRIDGE
    from higgs_talker.vllm_plugin.talker import talker_for

    ckpt = args.model
    cfg = TalkerConfig.from_pretrained(ckpt)
    tok = TalkerTokenizer.from_pretrained(ckpt, cfg)
    use_trtllm = args.trtllm[0] == "true"
    engine_args = stage0_engine_args(args.profiles[0], use_trtllm)
    t0 = time.perf_counter()
    llm = vllm.LLM(model=ckpt, dtype="bfloat16", logits_processors=[TEXT_ONLY_BRIDGE],
                   kernel_config={"enable_flashinfer_autotune": False}, **engine_args)  # fmt: skip
    start_s = time.perf_counter() - t0
    talker = talker_for(llm.llm_engine.vllm_config)
    rows_out = []
    for level in args.levels:
        records, wall = run_level(llm.llm_engine, talker, tok, cfg, level, args.seed + level)
        row = {"profile": args.profiles[0], "use_trtllm_attention": use_trtllm, "concurrency": level,
               "requests": len(records), "start_s": start_s, "wall_s": wall,
               "audio_s_per_s": sum(r["audio_s"] for r in records) / wall,
               "rows_exact": all(r["rows"] == r["want_rows"] for r in records)}  # fmt: skip
        for m in ("ttfp_ms", "rtf"):
            for q in (50, 90):
                row[f"{m}_p{q}"] = percentile([r[m] for r in records], q)
        rows_out.append(row)
        log(f"{row['profile']} trtllm={use_trtllm} C={level}: TTFP p50 {row['ttfp_ms_p50']:.1f} ms, "
            f"RTF p50 {row['rtf_p50']:.3f}, {row['audio_s_per_s']:.1f} audio s/s")  # fmt: skip
        stats = dict(talker.stats, local_mlp_replays=talker.local_mlp.replays,
                     decision=talker.graph_decision.reason)  # fmt: skip
        print("RESULT:" + json.dumps({"rows": rows_out, "stats": stats}), flush=True)  # after each level


def direct_rows(args: argparse.Namespace) -> list[dict]:
    """Our direct engine (auto graphs) at the same levels, prompts and lengths: bench_e2e.py in a subprocess."""
    out = Path(args.out or ".") / "direct_e2e"
    levels = ",".join(map(str, args.levels))
    script = str(Path(__file__).with_name("bench_e2e.py"))
    cmd = [sys.executable, script, "--model", args.model, "--modes", "auto", "--levels", levels, "--audio-s", "4,8",
           "--prompt-tokens", "30,200", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
    files = sorted(out.glob("e2e_*.json"))
    if proc.returncode or not files:
        log(f"direct engine run failed: {proc.stderr[-2000:]}")
        return []
    rows = []
    for r in json.loads(files[-1].read_text())["rows"]:
        if r.get("status") == "ok":
            rows.append({"profile": "direct_auto", "use_trtllm_attention": None, "concurrency": r["concurrency"],
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
        name = r["profile"] + ("" if r["use_trtllm_attention"] is None else f" trtllm={r['use_trtllm_attention']}")
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
    p.add_argument("--levels", type=ints_arg, default=list(LEVELS))
    p.add_argument("--model", default=None, help="checkpoint directory (default: a random 4B-shaped one)")
    p.add_argument("--ckpt-dir", default="/tmp/higgs_4b_random", help="where the random checkpoint is written")
    p.add_argument("--no-direct", action="store_true", help="skip our direct engine's rows")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-timeout", type=int, default=600, help="s per (profile, route) process, JIT included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return None
    import torch

    args.model = args.model or str(write_random_checkpoint(Path(args.ckpt_dir)))
    meta = environment(torch.device("cuda"), "bench_vllm.py", argv) | {
        "vllm": package_version("vllm"), "vllm_omni": package_version("vllm_omni"),
        "flashinfer": package_version("flashinfer"), "model": args.model,
    }  # fmt: skip
    writer = ResultFile(args.out, "vllm", meta)
    stats = {}
    for profile in args.profiles:
        for route in args.trtllm:
            cmd = [sys.executable, __file__, "--worker", "--profiles", profile, "--trtllm", route, "--model",
                   args.model, "--levels", ",".join(map(str, args.levels)), "--seed", str(args.seed)]  # fmt: skip
            # the worker's own log (vLLM's start-up, JIT, our graph decision) lies beside the JSON
            log_path = writer.path.with_name(f"{writer.path.stem}_{profile}_trtllm-{route}.log")
            t0, error = time.perf_counter(), None
            with open(log_path, "w", encoding="utf-8") as sink:
                try:
                    proc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, timeout=args.worker_timeout)
                    error = f"worker exited with status {proc.returncode}" if proc.returncode else None
                except subprocess.TimeoutExpired as exc:
                    error = f"timed out after {exc.timeout} s"
            text = log_path.read_text(encoding="utf-8", errors="replace")
            lines = [x for x in text.splitlines() if x.startswith("RESULT:")]
            if lines:  # the levels finished before a timeout still count
                result = json.loads(lines[-1][len("RESULT:") :])
                for row in result["rows"]:
                    writer.add(row)
                stats[f"{profile}/trtllm={route}"] = result["stats"]
            if error or not lines:
                writer.add({"profile": profile, "use_trtllm_attention": route == "true", "status": "error",
                            "error": error or "no result", "log_tail": text[-3000:]})  # fmt: skip
            log(f"{profile} trtllm={route}: {time.perf_counter() - t0:.0f} s")
    writer.meta["adapter_stats"] = stats
    writer.save()
    if not args.no_direct:
        for row in direct_rows(args):
            writer.add(row)
    cols = ["profile", "use_trtllm_attention", "concurrency", "ttfp_ms_p50", "ttfp_ms_p90", "rtf_p50", "rtf_p90",
            "audio_s_per_s"]  # fmt: skip
    done = [r for r in writer.rows if "concurrency" in r]
    print_table(done, cols, "vLLM deploy profiles")
    plot(writer.path, done)
    return writer


if __name__ == "__main__":
    main()

"""End to end through the API: time to first packet (TTFP) and real-time factor (RTF) under concurrency.

A closed loop per concurrency level C: C requests are submitted at once, and each time one finishes the next
is submitted, until ``--requests`` (default max(2C, 8)) have run. Prompts are 30-200 tokens and lengths are
forced to 5-20 s of audio with ``max_frames`` (with random weights the EOC row is zeroed, so no request stops
early: see bench_decode.py). Each level runs once per ``--sampling`` name (default ``deploy,greedy``: the
deploy profiles' temperature 1.0, top_p 0.95, top_k 50 with seeded requests, the headline, then the argmax),
on the same built talker; rows and requests are labelled ``sampling``. Per request:

- TTFP: submitted -> the first aligned frame is complete (the request has N = 8 delayed rows: its prefill
  plus the 7 ramp-up steps of the delay pattern). ``ttfp_stream_ms`` is one step later, when
  ``HiggsTalker.stream()`` yields that frame (it waits for row N + 1 to know the frame is not the last).
- RTF: (finished - submitted) / audio duration (queueing included); ``rtf_engine`` counts only the
  request's own prefill and decode time, as ``GenerationResult.rtf`` does.

p50/p90/p99 of each over the level's requests, plus the level's audio seconds per wall second.

    python benchmarks/bench_e2e.py --out $OUT                     # 4B shape, mode auto, deploy and greedy
    python benchmarks/bench_e2e.py --modes eager,auto --levels 1,16 --out $OUT
    python benchmarks/bench_e2e.py --prefill-graphs both --out $OUT  # auto without and with prefill graphs
    python benchmarks/bench_e2e.py --voice-s 10 --prefix-caching both --out $OUT  # one voice, with/without cache
    python benchmarks/bench_e2e.py --device cpu --tiny            # smoke test, seconds

``--voice-s S``: every request clones one voice (S seconds of random reference codes, the same for all, with a
reference text) before its own text, as a service with a few voices would see; with ``--prefix-caching on``
the requests after the first find that voice's prompt blocks in the cache and prefill only their own text.
"""

from __future__ import annotations

import argparse
import random
import string
import time
from collections import Counter, deque
from collections.abc import Sequence

import torch
from bench_decode import Variant, build_talker, model_config, suppress_eoc
from common import (
    SAMPLINGS,
    ResultFile,
    add_sampling_option,
    environment,
    error_text,
    floats_arg,
    free_memory,
    ints_arg,
    log,
    percentile,
    print_table,
    resolve_device,
    strs_arg,
    sync,
)

from higgs_talker import HiggsTalker, Reference, SamplingParams
from higgs_talker.heads.delay import codec_frames

METRICS = ("ttfp_ms", "ttfp_stream_ms", "rtf", "rtf_engine", "ms_per_step", "queue_ms")


def make_jobs(talker: HiggsTalker, n: int, args: argparse.Namespace, seed: int, sampling: str) -> list[tuple]:
    """n (prompt, SamplingParams, prompt_tokens, target_frames) with random lengths, built before timing; the
    requests sample as ``sampling`` (a name in SAMPLINGS), each with its own seed."""
    rng = random.Random(seed)
    cfg = talker.cfg
    voice = None
    if args.voice_s:  # one voice for every request (and every level): the same codes from a fixed seed
        frames = max(1, round(args.voice_s * cfg.frame_rate))
        g = torch.Generator().manual_seed(args.seed)
        codes = torch.randint(0, cfg.num_real_codes, (frames, cfg.num_codebooks), generator=g)
        voice = Reference(codes, text="the reference speaker says these words")
    jobs = []
    for i in range(n):
        words = rng.randint(args.prompt_tokens[0], args.prompt_tokens[1])
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(max(1, words - 3)))
        prompt = talker.build_prompt(text, voice)
        frames = round(rng.uniform(args.audio_s[0], args.audio_s[1]) * cfg.frame_rate)
        params = SamplingParams(**SAMPLINGS[sampling], max_frames=frames, seed=seed + i)
        jobs.append((prompt, params, len(prompt), frames))
    return jobs


def run_level(talker: HiggsTalker, concurrency: int, jobs: list[tuple]) -> tuple[list[dict], float]:
    """Closed loop at ``concurrency``; returns per-request records and the level's wall seconds."""
    eng, cfg = talker.engine, talker.cfg
    n = cfg.num_codebooks
    queue, live = deque(jobs), {}

    def submit() -> None:
        prompt, params, tokens, frames = queue.popleft()
        t = time.perf_counter()
        rid = eng.add_request(prompt, params)
        live[rid] = {"t_submit": t, "rows": 0, "prompt_tokens": tokens, "target_frames": frames}

    max_steps = sum(job[1].max_frames + n for job in jobs) + 10 * len(jobs) + 100  # a hang guard, never reached
    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(queue))):
        submit()
    records, steps = [], 0
    try:
        while live:
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"{len(live)} requests still live after {max_steps} steps")
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                rec = live.get(o.request_id)
                if rec is None:
                    continue
                if o.row is not None:
                    rec["rows"] += 1
                    if rec["rows"] == n:
                        rec["t_frame"] = now
                    elif rec["rows"] == n + 1:
                        rec["t_stream"] = now
                if o.finished:
                    records.append(finish(rec, eng.pop_finished(o.request_id), talker))
                    del live[o.request_id]
                    if queue:
                        submit()
    finally:
        for rid in list(live):
            eng.cancel(rid)
            eng.requests.pop(rid, None)
    return records, time.perf_counter() - t0


def finish(rec: dict, req, talker: HiggsTalker) -> dict:
    cfg = talker.cfg
    rows = torch.stack(req.rows).long() if req.rows else torch.zeros(0, cfg.num_codebooks, dtype=torch.long)
    frames = int(codec_frames(rows, cfg.num_real_codes).shape[0])
    audio_s = frames / cfg.frame_rate
    first = req.first_row_at or req.finished_at
    decode_s = req.finished_at - first
    total_s = req.finished_at - rec["t_submit"]
    t_frame, t_stream = rec.get("t_frame"), rec.get("t_stream")
    return {
        "prompt_tokens": rec["prompt_tokens"],
        "target_frames": rec["target_frames"],
        "frames": frames,
        "audio_s": audio_s,
        "rows": len(req.rows),
        "finish_reason": req.finish_reason,
        "preemptions": req.preemptions,
        "cached_tokens": req.cached_tokens,
        "ttfp_ms": (t_frame - rec["t_submit"]) * 1e3 if t_frame else None,
        "ttfp_stream_ms": (t_stream - rec["t_submit"]) * 1e3 if t_stream else None,
        "queue_ms": max(0.0, (first - rec["t_submit"]) * 1e3 - req.prefill_ms),
        "prefill_ms": req.prefill_ms,
        "ms_per_step": decode_s * 1e3 / max(len(req.rows) - 1, 1),
        "rtf": total_s / audio_s if audio_s else None,
        "rtf_engine": (req.prefill_ms / 1e3 + decode_s) / audio_s if audio_s else None,
    }


def summarize(mode: str, sampling: str, concurrency: int, records: list[dict], wall_s: float) -> dict:
    row = {"mode": mode, "sampling": sampling, "concurrency": concurrency, "requests": len(records), "wall_s": wall_s}
    for m in METRICS:
        vals = [r[m] for r in records if r.get(m) is not None]
        for q in (50, 90, 99):
            row[f"{m}_p{q}"] = percentile(vals, q)
    audio = sum(r["audio_s"] for r in records)
    row["audio_s"] = audio
    row["audio_s_per_s"] = audio / wall_s if wall_s else None
    row["frames_per_s"] = sum(r["frames"] for r in records) / wall_s if wall_s else None
    row["finish_reasons"] = dict(Counter(r["finish_reason"] for r in records))
    row["preemptions"] = sum(r["preemptions"] for r in records)
    row["status"] = "ok"
    return row


def warm_up(talker: HiggsTalker, concurrency: int) -> float:
    """Requests with staggered lengths so the batch passes through every size 1..C once (graph buckets)."""
    t0 = time.perf_counter()
    jobs = []
    for i in range(concurrency):
        prompt = talker.build_prompt("warm up " + "x" * (i % 7))
        jobs.append((prompt, SamplingParams(temperature=0.0, max_frames=2 + i), len(prompt), 2 + i))
    run_level(talker, concurrency, jobs)
    sync(torch.device(talker.engine.device))
    return time.perf_counter() - t0


def run_mode(variant: Variant, cfg, args, writer: ResultFile, deadline: float) -> None:
    device = torch.device(args.device)
    levels = args.levels
    mode = variant.mode + variant.prefill_label  # the library's defaults otherwise
    try:
        t0 = time.perf_counter()
        talker = build_talker(args, cfg, variant, num_blocks_for(args, cfg))
        if not args.model:
            suppress_eoc(talker)
        build_s = time.perf_counter() - t0
        warm_s = warm_up(talker, max(levels))
    except Exception as exc:  # noqa: BLE001 - record and go on with the next mode
        for c in levels:
            for s in args.sampling:
                writer.add({"mode": mode, "sampling": s, "concurrency": c, "status": "error",
                            "error": f"build: {error_text(exc)}"})  # fmt: skip
        log(f"{mode}: build failed: {error_text(exc)}")
        free_memory(device)
        return
    log(f"{mode}: built in {build_s:.1f} s, warm-up {warm_s:.1f} s")
    for c, s in [(c, s) for c in levels for s in args.sampling]:
        if time.perf_counter() > deadline:
            writer.add({"mode": mode, "sampling": s, "concurrency": c, "status": "skipped", "error": "time budget"})
            continue
        n = args.requests or max(2 * c, 8)
        try:
            jobs = make_jobs(talker, n, args, seed=args.seed + 1000 * c, sampling=s)
            records, wall = run_level(talker, c, jobs)
            row = summarize(mode, s, c, records, wall) | {"build_s": build_s, "warmup_s": warm_s}
            writer.data.setdefault("requests", []).extend(
                {"mode": mode, "sampling": s, "concurrency": c} | r for r in records
            )
        except Exception as exc:  # noqa: BLE001
            row = {"mode": mode, "sampling": s, "concurrency": c, "status": "error", "error": error_text(exc)}
        writer.add(row)
        log(
            f"{mode:12s} {s:7s} C={c:<3d} TTFP p50 {row.get('ttfp_ms_p50', float('nan')):8.1f} ms  "
            f"RTF p50 {row.get('rtf_p50', float('nan')):.3f}  {row['status']} {row.get('error', '')}"
        )
    del talker
    free_memory(device)


def num_blocks_for(args: argparse.Namespace, cfg) -> int:
    voice = round(args.voice_s * cfg.frame_rate) + cfg.num_codebooks + 48 if args.voice_s else 0  # rows + ref text
    longest = voice + args.prompt_tokens[1] + 4 + round(args.audio_s[1] * cfg.frame_rate) + cfg.num_codebooks + 16
    return max(args.levels) * -(-longest // 16) + 64


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--model", default=None, help="checkpoint directory (default: random weights)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--modes", type=strs_arg, default=None, help="graph modes (default auto; eager on CPU)")
    p.add_argument("--prefill-graphs", choices=("off", "on", "both"), default="on",
                   help="prefill graphs (the library's default: on; off: rows MODE-eagerprefill)")  # fmt: skip
    p.add_argument("--prefix-caching", choices=("off", "on", "both"), default="off",
                   help="prefix caching (rows MODE+pcache); off: the library's default")  # fmt: skip
    p.add_argument("--voice-s", type=float, default=0.0, help="seconds of one reference voice in every prompt")
    p.add_argument("--levels", type=ints_arg, default=None, help="concurrency levels (default 1,4,16,64)")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default max(2C, 8))")
    p.add_argument("--prompt-tokens", type=ints_arg, default=None, help="min,max prompt tokens (default 30,200)")
    p.add_argument("--audio-s", type=floats_arg, default=None, help="min,max seconds of audio (default 5,20)")
    add_sampling_option(p, "level")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining levels after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results)")
    args = p.parse_args(argv)
    args.modes = args.modes or (["auto"] if torch.device(args.device).type == "cuda" else ["eager"])  # graphs: CUDA's
    if args.tiny:
        args.levels = args.levels or [1, 2]
        args.requests = args.requests or 2
        args.prompt_tokens = args.prompt_tokens or [10, 30]
        args.audio_s = args.audio_s or [0.4, 0.8]
    args.levels = args.levels or [1, 4, 16, 64]
    args.prompt_tokens = args.prompt_tokens or [30, 200]
    args.audio_s = args.audio_s or [5.0, 20.0]
    args.max_num_seqs = max(args.max_num_seqs, max(args.levels))
    return args


def main(argv: Sequence[str] | None = None) -> ResultFile:
    args = parse_args(argv)
    device = resolve_device(args.device)
    t_start = time.perf_counter()
    cfg = model_config(args)
    meta = environment(device, "bench_e2e.py", argv)
    meta |= {
        "model": args.model or ("tiny (random)" if args.tiny else "4B shape (random)"),
        "eoc_suppressed": not args.model,
        "prompt_tokens": args.prompt_tokens,
        "voice_s": args.voice_s,
        "audio_s": args.audio_s,
        "samplings": {s: SAMPLINGS[s] for s in args.sampling},
        "headline_sampling": args.sampling[0],
        "ttfp": "submitted -> N delayed rows exist (first aligned frame complete)",
        "rtf": "(finished - submitted) / audio seconds; rtf_engine: (own prefill + decode) / audio seconds",
    }
    writer = ResultFile(args.out, "e2e", meta, smoke=args.tiny)
    log(f"writing {writer.path}")
    deadline = t_start + args.budget_s
    choice = {"off": (False,), "on": (True,), "both": (False, True)}
    for mode in args.modes:
        for graphs in choice[args.prefill_graphs]:
            for caching in choice[args.prefix_caching]:
                variant = Variant(mode, async_scheduling=None, prefill_graphs=graphs, prefix_caching=caching)
                run_mode(variant, cfg, args, writer, deadline)
    writer.meta["wall_s"] = time.perf_counter() - t_start
    writer.save()
    cols = ["mode", "sampling", "concurrency", "requests", "ttfp_ms_p50", "ttfp_ms_p90", "ttfp_ms_p99", "rtf_p50",
            "rtf_p90", "rtf_p99", "ms_per_step_p50", "audio_s_per_s", "status"]  # fmt: skip
    title = f"\nend to end (TTFP ms, RTF = wall / audio; sampling {', '.join(args.sampling)}, the first the headline)"
    print_table(writer.rows, cols, title=title)
    print(f"\nwrote {writer.path} ({writer.meta['wall_s']:.0f} s)")
    errors = [r["error"] for r in writer.rows if r["status"] == "error"]
    if errors and len(errors) == len(writer.rows):
        raise SystemExit(f"bench_e2e.py: every row failed, the first with {errors[0]}")
    return writer


if __name__ == "__main__":
    main()

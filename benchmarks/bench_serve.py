"""The speech server over HTTP against the direct API, in one run: time to the first audio byte, RTF, audio
seconds per second, at several concurrency levels.

This process builds the talker, times the direct API (``HiggsTalker.stream_audio`` from C threads), then serves
it with ``higgs-talker serve``'s app (uvicorn on 127.0.0.1, an ephemeral port) and times it over HTTP from a
load generator in a child process (this script with ``--client``: httpx, asyncio, no torch), so the client
does not compete with the server for the interpreter. Each level is a closed loop: C requests at once, the next
one sent as one ends, until ``--requests`` (default max(2C, 8)) have run; streamed 16-bit PCM.

Per request: TTFA (sent -> first audio byte; the direct API: called -> first chunk), RTF = wall / audio seconds,
and ``stall_ms``: how long a player that starts with the first audio and never pauses would wait for audio after
that (``http_load.Playback``; the gaps a listener hears, such as the one after a one-frame first chunk).
Per level: p50/p90 of each, and audio seconds per wall second. Targets (issue #29): at one stream TTFA <= 60 ms
and RTF <= 0.1; at 16 streams >= 100 audio s/s.

Each level runs once per ``--sampling`` name (default ``deploy,greedy``; rows labelled ``sampling``): ``deploy``
is the deploy profiles' temperature 1.0, top_p 0.95, top_k 50 (seeded requests), the headline that the targets
are read from; ``greedy`` the argmax beside it.

Random weights at the 4B shape (EOC suppressed, so ``max_new_tokens`` sets every length) with the real codec's shape
(``codec.HIGGS_V3_CODEC``, random weights; ``--codec tiny``: the tiny checkpoint's, much cheaper, as runs before
2026-12-05 had); ``--model DIR`` runs a checkpoint with its own codec.
Texts are random words, long enough that the server's frame cap (``splitting.frame_budget``) is above the length
asked for.

    python benchmarks/bench_serve.py --out $OUT                      # H200: 4B shape, levels 1,4,16,64
    python benchmarks/bench_serve.py --chunking both --levels 1,16   # exact vs vllm-omni's chunk cuts
    python benchmarks/bench_serve.py --chunking exact,fast-start --levels 1 --paths direct  # first audio
    python benchmarks/bench_serve.py --device cpu --tiny             # smoke test, seconds
    python benchmarks/bench_serve.py --paths frames,direct --levels 16,64   # the engine's frames vs + the codec
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from http_load import Playback

SAMPLE_BYTES = 2  # 16-bit PCM
TARGETS = {"ttfa_ms_p50 at 1": 60.0, "rtf_p50 at 1": 0.1, "audio_s_per_s at 16": 100.0}


# ---------------------------------------------------------------------------------------------------------
# the load generator (child process): no torch, no higgs_talker


async def _client_level(url: str, jobs: list[dict], concurrency: int, sample_rate: int) -> dict:
    import httpx
    from http_load import stream_speech

    queue, records = deque(jobs), []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker() -> None:
            while queue:
                job = queue.popleft()
                body = {"input": job["text"], "response_format": "pcm", "seed": job["seed"],
                        "max_new_tokens": job["frames"], **job["sampling"]}  # fmt: skip
                t0, first, end, size, stall = await stream_speech(
                    client, body, bytes_per_second=SAMPLE_BYTES * sample_rate
                )
                records.append(_record(job, t0, first, end, size / SAMPLE_BYTES / sample_rate, stall))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)))))
    return {"records": records, "wall_s": time.perf_counter() - t0}


def _record(job: dict, t0: float, first: float | None, end: float, audio_s: float, stall_s: float | None) -> dict:
    return {
        "prompt_chars": len(job["text"]),
        "frames": job["frames"],
        "audio_s": audio_s,
        "ttfa_ms": (first - t0) * 1e3 if first is not None else None,
        "total_s": end - t0,
        "rtf": (end - t0) / audio_s if audio_s else None,
        "stall_ms": stall_s * 1e3 if stall_s is not None else None,  # a player's waits after the first audio
    }


def client_main(args: argparse.Namespace) -> None:
    spec = json.loads(Path(args.jobs).read_text())
    out = asyncio.run(_client_level(args.client, spec["jobs"], args.concurrency, spec["sample_rate"]))
    print(json.dumps(out))


# ---------------------------------------------------------------------------------------------------------
# the server side (this process)


def make_jobs(n: int, args: argparse.Namespace, seed: int, frame_rate: int, sampling: str) -> list[dict]:
    """n requests: random words, a forced length of audio, each text long enough for the server's frame cap,
    sampled as ``sampling`` (a name in SAMPLINGS) with its own seed."""
    from common import SAMPLINGS

    from higgs_talker.splitting import frame_budget

    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        frames = max(1, round(rng.uniform(*args.audio_s) * frame_rate))
        chars = rng.randint(*args.prompt_chars)
        words = []
        while sum(len(w) + 1 for w in words) < chars or frame_budget(" ".join(words) + ".", frame_rate) < frames:
            words.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
        jobs.append({"text": " ".join(words) + ".", "frames": frames, "seed": seed + i,
                     "sampling": dict(SAMPLINGS[sampling])})  # fmt: skip
    return jobs


def run_direct(
    talker, jobs: list[dict], concurrency: int, chunking, part_chars: int, codec: bool = True
) -> tuple[list[dict], float]:
    """The same closed loop through ``HiggsTalker.stream_audio`` from C threads (the server's path, minus HTTP);
    ``codec=False``: through ``HiggsTalker.stream``, frames only (the ``frames`` path: what the engine and its
    streaming deliver with no decoding; TTFA is the first frame, audio seconds are frames / frame rate)."""
    from higgs_talker import SamplingParams

    queue, records, errors, lock = deque(jobs), [], [], threading.Lock()
    rate = talker.cfg.sample_rate if codec else talker.cfg.frame_rate

    def worker() -> None:
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    job = queue.popleft()
                params = SamplingParams(**job["sampling"], seed=job["seed"], max_frames=job["frames"])
                t0, first, samples, player = time.perf_counter(), None, 0, Playback()
                if codec:
                    chunks = talker.stream_audio(job["text"], params, chunking=chunking, split=part_chars)
                else:
                    chunks = talker.stream(job["text"], params, split=part_chars)  # one frame [C] at a time
                for chunk in chunks:
                    now, n = time.perf_counter(), chunk.numel() if codec else 1
                    if first is None and chunk.numel():
                        first = now
                    samples += n
                    player.arrive(now, n / rate)
                rec = _record(job, t0, first, time.perf_counter(), samples / rate, player.stall_s)
                with lock:
                    records.append(rec)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(min(concurrency, len(jobs)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return records, time.perf_counter() - t0


def run_http(url: str, jobs: list[dict], concurrency: int, sample_rate: int) -> tuple[list[dict], float]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"jobs": jobs, "sample_rate": sample_rate}, f)
    try:
        cmd = [sys.executable, __file__, "--client", url, "--jobs", f.name, "--concurrency", str(concurrency)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    finally:
        Path(f.name).unlink()
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed: {done.stderr.strip().splitlines()[-1:]}")
    out = json.loads(done.stdout)
    return out["records"], out["wall_s"]


def summarize(records: list[dict], wall_s: float) -> dict:
    from common import percentile

    row = {"requests": len(records), "wall_s": wall_s}
    for m in ("ttfa_ms", "rtf", "stall_ms"):
        vals = [r[m] for r in records if r.get(m) is not None]
        row[f"{m}_p50"], row[f"{m}_p90"] = percentile(vals, 50), percentile(vals, 90)
    audio = sum(r["audio_s"] for r in records)
    row["audio_s"] = audio
    row["audio_s_per_s"] = audio / wall_s if wall_s else None
    row["status"] = "ok"
    return row


def build_talker(args: argparse.Namespace):
    import torch
    from bench_decode import SHAPE_4B, suppress_eoc

    from higgs_talker import HiggsTalker, TalkerConfig, TextConfig
    from higgs_talker.audio import CodecLoader
    from higgs_talker.tiny import tiny_checkpoint, tiny_config

    frames = round(args.audio_s[1] * 25)
    chars = max(args.prompt_chars[1], math.ceil((frames - 50) / 3.125)) + 20  # make_jobs' longest text, about
    longest = 2 * chars + 8 + frames + 16  # tokens of one request (two a character: a byte-level tokenizer's worst)
    options = {"max_num_seqs": max(args.max_num_seqs, max(args.levels)), "graph_mode": args.graph_mode}
    options["num_blocks"] = max(args.levels) * -(-longest // 16) + 64
    if args.model:
        return HiggsTalker.from_pretrained(args.model, device=args.device, dtype=args.dtype, **options)
    cfg = tiny_config() if args.tiny else TalkerConfig(text=TextConfig(**SHAPE_4B))
    talker = HiggsTalker.from_config(cfg, device=args.device, dtype=args.dtype, seed=args.seed, **options)
    suppress_eoc(talker)

    class RandomCodecLoader(CodecLoader):
        """Decodes with the real codec's shape and random weights (``HIGGS_V3_CODEC``) instead of ``path``'s codec."""

        def decoder(self):
            from higgs_talker.codec import HIGGS_V3_CODEC, Codec

            with self._lock:
                if self._decoder is None:
                    codec = Codec.from_config(HIGGS_V3_CODEC, encoder=False, device=self.device, dtype=self.dtype)
                    self._decoder = self._check_fits(codec, self.path)
                return self._decoder

    loader = CodecLoader if args.codec == "tiny" else RandomCodecLoader
    talker.codec_loader = loader(tiny_checkpoint(), torch.device(args.device), talker=cfg)
    return talker


CODECS = {"4b": "the real codec's shape, random weights", "tiny": "the tiny checkpoint's (cheaper than the real one)"}


def warm_up(talker, url: str | None, args: argparse.Namespace, chunking) -> float:
    """A few requests at every level's size and sampling, through the direct API and (``url``: not None where the
    run has an HTTP path) the server, so graphs (a sampler variant per sampling), kernels and the codec are warm."""
    from common import SAMPLINGS

    t0 = time.perf_counter()
    for c in sorted({1, max(args.levels)}):
        for name in args.sampling:
            jobs = [{"text": "warm up " + "x" * (i % 7) + ".", "frames": 30 + i % 5, "seed": i,
                     "sampling": dict(SAMPLINGS[name])} for i in range(c)]  # fmt: skip
            run_direct(talker, jobs, c, chunking, args.part_chars)
            if url is not None:
                run_http(url, jobs, c, talker.cfg.sample_rate)
    return time.perf_counter() - t0


class _Server:
    """``higgs-talker serve``'s app on 127.0.0.1 (an ephemeral port) in a thread of this process."""

    def __init__(self, serving) -> None:
        from higgs_talker.serve.app import make_server

        self.server, self.sock = make_server(serving, "127.0.0.1", 0, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from common import add_sampling_option, floats_arg, ints_arg, strs_arg

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--graph-mode", default=None, help="default: auto on CUDA, eager on CPU")
    p.add_argument("--model", default=None, help="checkpoint directory with its codec (default: random weights)")
    p.add_argument("--tiny", action="store_true", help="the tiny shape (CPU smoke test)")
    p.add_argument("--codec", choices=("4b", "tiny"), default="4b",
                   help="without --model: the real codec shape (random weights; default) or the tiny one")  # fmt: skip
    p.add_argument("--paths", type=strs_arg, default=["direct", "http"],
                   help="direct,http (default both); frames: the direct engine with no codec")  # fmt: skip
    p.add_argument(
        "--chunking",
        type=strs_arg,
        default=["exact"],
        help="exact, upstream, fast-start, exact-no-ramp, fast-start-1, fast-start-2 (a list; both: exact,upstream)",
    )
    add_sampling_option(p, "level")
    p.add_argument("--levels", type=ints_arg, default=None, help="concurrency levels (default 1,4,16,64)")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default max(2C, 8))")
    p.add_argument("--audio-s", type=floats_arg, default=None, help="min,max seconds of audio (default 5,20)")
    p.add_argument("--prompt-chars", type=ints_arg, default=None, help="min,max characters of text (default 30,200)")
    p.add_argument("--part-chars", type=int, default=300)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=480.0, help="skip the remaining levels this long after the build")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for this process (Python's default is 5 ms): how long a thread that "
                   "wants the GIL may wait for one that holds it")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results)")
    args = p.parse_args(argv)
    if args.tiny:
        args.codec = "tiny"
        args.levels = args.levels or [1, 2]
        args.requests = args.requests or 2
        args.audio_s = args.audio_s or [0.4, 0.8]
        args.prompt_chars = args.prompt_chars or [10, 30]
    args.levels = args.levels or [1, 4, 16, 64]
    args.audio_s = args.audio_s or [5.0, 20.0]
    args.prompt_chars = args.prompt_chars or [30, 200]
    bad = [x for x in args.paths if x not in ("direct", "http", "frames")]
    if bad:
        p.error(f"--paths: unknown {bad}; use direct, http and/or frames")
    return args


def main(argv: Sequence[str] | None = None):
    if argv is None and "--client" in sys.argv:  # the load generator: only the flags it needs
        c = argparse.ArgumentParser()
        c.add_argument("--client", required=True)
        c.add_argument("--jobs", required=True)
        c.add_argument("--concurrency", type=int, required=True)
        return client_main(c.parse_args())
    from common import SAMPLINGS, ResultFile, environment, error_text, log, print_table, resolve_device

    from higgs_talker.codec.streaming import AudioChunking
    from higgs_talker.serve.serving import CHUNKINGS, ServeConfig, SpeechServing

    args = parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    device = resolve_device(args.device)
    t_start = time.perf_counter()
    meta = environment(device, "bench_serve.py", argv)
    meta |= {
        "model": args.model or ("tiny shape (random)" if args.tiny else "4B shape (random)"),
        "codec": "the checkpoint's" if args.model else CODECS[args.codec],
        "eoc_suppressed": not args.model, "samplings": {n: SAMPLINGS[n] for n in args.sampling},
        "headline_sampling": args.sampling[0], "audio_s": args.audio_s,
        "prompt_chars": args.prompt_chars, "targets": TARGETS,
        "ttfa": "request sent -> first audio byte (HTTP, streamed pcm); direct: call -> first stream_audio chunk",
        "rtf": "request wall time / audio seconds", "switch_interval_s": sys.getswitchinterval(),
    }  # fmt: skip
    writer = ResultFile(args.out, "serve", meta, smoke=args.tiny)
    log(f"writing {writer.path}")
    t0 = time.perf_counter()
    talker = build_talker(args)
    writer.meta["talker_build_s"] = time.perf_counter() - t0
    log(f"talker built in {writer.meta['talker_build_s']:.1f} s")
    talker.codec  # noqa: B018 - load the decoder before timing
    writer.meta["build_s"] = time.perf_counter() - t0
    log(f"codec loaded, build {writer.meta['build_s']:.1f} s")
    deadline = time.perf_counter() + args.budget_s  # a slow first build on a fresh machine does not eat the levels
    chunkings = list(dict.fromkeys(n for c in args.chunking for n in (["exact", "upstream"] if c == "both" else [c])))
    # + rules the server has no name for: the default before its ramp (2026-12-05), fast start's first chunk shorter
    rules = CHUNKINGS | {"exact-no-ramp": AudioChunking(ramp=False)}
    rules |= {f"fast-start-{n}": AudioChunking(first_chunk_frames=n, first_holdback_frames=0) for n in (1, 2)}
    if unknown := [c for c in chunkings if c not in rules]:
        raise SystemExit(f"bench_serve.py: unknown --chunking {unknown}; choose from {', '.join(rules)}, both")
    for name in chunkings:
        config = ServeConfig(model_name="bench", part_chars=args.part_chars, chunking=name if name in CHUNKINGS
                             else "exact", max_new_tokens=1 << 16)  # fmt: skip
        serving = SpeechServing(talker, config)
        if name not in CHUNKINGS:  # a rule the server has no name for: served all the same
            serving.chunking = rules[name]
            talker.prepare_audio(rules[name])
        # the server runs only for an HTTP path: --paths direct,frames needs neither it nor the server extra
        server = _Server(serving) if "http" in args.paths else None
        url = None if server is None else server.url
        try:
            writer.meta[f"warmup_s_{name}"] = warm_up(talker, url, args, rules[name])
            for c, sampling in ((c, s) for c in args.levels for s in args.sampling):
                n = args.requests or max(2 * c, 8)
                jobs = make_jobs(n, args, args.seed + 1000 * c, talker.cfg.frame_rate, sampling)
                for path in args.paths:
                    row = {"path": path, "chunking": name, "sampling": sampling, "concurrency": c}
                    if time.perf_counter() > deadline:
                        writer.add(row | {"status": "skipped", "error": "time budget"})
                        continue
                    try:
                        if path in ("direct", "frames"):
                            records, wall = run_direct(talker, jobs, c, rules[name], args.part_chars,
                                                       codec=path == "direct")  # fmt: skip
                        else:
                            records, wall = run_http(url, jobs, c, talker.cfg.sample_rate)
                        row |= summarize(records, wall)
                        writer.data.setdefault("requests", []).extend(row | r for r in records)
                    except Exception as exc:  # noqa: BLE001 - record it and go on
                        row |= {"status": "error", "error": error_text(exc)}
                    writer.add(row)
                    log(f"{path:6s} {name:8s} {sampling:6s} C={c:<3d} TTFA p50 "
                        f"{row.get('ttfa_ms_p50', math.nan):8.1f} ms  RTF p50 {row.get('rtf_p50', math.nan):.3f}  "
                        f"{row.get('audio_s_per_s', math.nan):.1f} audio s/s "
                        f"{row['status']} {row.get('error', '')}")  # fmt: skip
        finally:
            if server is not None:
                server.stop()
    writer.set("targets_met", targets_met(writer.rows, args.sampling[0]))
    writer.meta["wall_s"] = time.perf_counter() - t_start
    writer.save()
    cols = ["path", "chunking", "sampling", "concurrency", "requests", "ttfa_ms_p50", "ttfa_ms_p90", "rtf_p50",
            "rtf_p90", "stall_ms_p50", "stall_ms_p90", "audio_s_per_s", "status"]  # fmt: skip
    print_table(writer.rows, cols, title="\nspeech server over HTTP vs the direct API (TTFA ms, RTF = wall / audio)")
    print(f"\ntargets (HTTP, {args.sampling[0]}): {json.dumps(writer.data['targets_met'])}")
    print(f"wrote {writer.path} ({writer.meta['wall_s']:.0f} s)")
    return writer


def targets_met(rows: list[dict], sampling: str) -> dict:
    """Each target against the HTTP rows of ``sampling`` (the headline) that measure it (None: not measured)."""
    out = {}
    for key, limit in TARGETS.items():
        metric, level = key.split(" at ")
        vals = [r.get(metric) for r in rows if r.get("path") == "http" and r.get("concurrency") == int(level)
                and r.get("sampling") == sampling and r.get("status") == "ok"]  # fmt: skip
        higher = metric == "audio_s_per_s"
        best = (max(vals) if higher else min(vals)) if vals else None
        met = None if best is None else (best >= limit if higher else best <= limit)
        out[key] = {"value": best, "limit": limit, "met": met}
    return out


if __name__ == "__main__":
    main()

"""The Stage-1 codec's cost per second of audio: one-shot decode, streamed decode, reference encode.

The 4B-shaped codec (``codec.HIGGS_V3_CODEC``, random weights; decoding touches 21.6M values, encoding the
whole 201M) in fp32 and bf16. Per dtype:

- ``decode``: one call decoding ``--seconds`` of audio (``--seconds`` x 25 frames);
- ``stream_exact``: the same frames pushed one at a time through ``StreamingDecoder`` with the default
  ``AudioChunking`` (chunks of 1, 1, 2, 4, 8, 16, then 25 frames; left context and holdback = the decoder's reach):
  total and per-chunk time, the wait before the first chunk, and the difference from the one-shot audio;
- ``stream_upstream``: the same with ``UPSTREAM_CHUNKING`` (holdback 4: upstream's schedule and deviations);
- ``stream_exact_graphs``, ``stream_upstream_graphs`` (CUDA): the same with the windows' decodes captured as CUDA
  graphs first (``cuda_graphs.codec.capture_stream_graphs``: ``capture_s``, the shapes kept, each shape's eager
  and graph ms);
- ``encode``: a ``--ref-seconds`` reference at 24 kHz (HuBERT, the encoders and the quantizer).

Timing: one warm-up call (excluded; reported as ``warmup_ms``, because on CPU the first call at a new length
also builds oneDNN kernels), then ``--repeats`` calls timed one by one (CUDA events on GPU, a host clock on
CPU; the streamed modes a host clock everywhere: a push returns its chunk on the host, decoded on the codec's own
CUDA stream) and the median. ``ms_per_audio_s`` is that median over the seconds of audio; ``x_realtime`` its
inverse (audio seconds per second of codec time).

    python benchmarks/bench_codec.py --out $OUT                   # 4B shape on CUDA, fp32 + bf16 (H200: ~1 min)
    python benchmarks/bench_codec.py --device cpu --quick         # 4B shape on CPU, 2 s of audio (~1-2 min)
    python benchmarks/bench_codec.py --device cpu --tiny --quick  # smoke test (the tiny codec), seconds
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from common import (
    ResultFile,
    StepTimer,
    environment,
    error_text,
    free_memory,
    log,
    median,
    print_table,
    resolve_device,
    strs_arg,
    sync,
)

from higgs_talker.codec import HIGGS_V3_CODEC, TINY_CODEC, UPSTREAM_CHUNKING, AudioChunking, Codec
from higgs_talker.codec.streaming import window_lengths
from higgs_talker.cuda_graphs.codec import capture_stream_graphs

MODES = ("decode", "stream_exact", "stream_exact_graphs", "stream_upstream", "stream_upstream_graphs", "encode")
CPU_MODES = tuple(m for m in MODES if not m.endswith("_graphs"))  # graphs are CUDA's
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(fn, device: torch.device, repeats: int) -> tuple[list[float], float]:
    """(per-call ms of ``repeats`` timed calls, warm-up ms); CUDA events on GPU."""
    t0 = time.perf_counter()
    fn()
    sync(device)
    warmup = (time.perf_counter() - t0) * 1e3
    timer = StepTimer(device)
    for _ in range(repeats):
        with timer:
            fn()
    return timer.ms(), warmup


def stream_once(codec: Codec, codes: torch.Tensor, chunking: AudioChunking, timer: StepTimer | None = None):
    """Push ``codes`` frame by frame; the chunks and, per emitted chunk, the frames received before it."""
    decoder = codec.stream(chunking)
    chunks, waited = [], []
    for i in range(codes.shape[0]):
        if timer is None:
            chunk = decoder.push(codes[i])
        else:
            with timer:
                chunk = decoder.push(codes[i])
        if chunk is not None:
            chunks.append(chunk)
            waited.append(i + 1)
    chunk = decoder.finish()
    if chunk is not None:
        chunks.append(chunk)
        waited.append(codes.shape[0])
    return chunks, waited


def row_decode(codec: Codec, codes: torch.Tensor, device: torch.device, args) -> dict:
    ms, warm = timed(lambda: codec.decode(codes), device, args.repeats)
    return {"ms": median(ms), "warmup_ms": warm}


def row_stream(
    codec: Codec, codes: torch.Tensor, chunking: AudioChunking, device: torch.device, args, graphs: bool = False
) -> dict:
    """A streamed decode; ``graphs``: its windows' decodes captured first (``capture_stream_graphs``, kept where
    checked equal to eager and faster), else every window decoded eagerly."""
    rule = chunking.resolved(codec.context_frames)
    captured, codec.graphs = codec.graphs, None
    report = {}
    if graphs:
        codec.graphs = captured
        t0 = time.perf_counter()
        report = capture_stream_graphs(codec, window_lengths(rule)) or {}
        capture_s = time.perf_counter() - t0
    whole = codec.decode(codes).cpu()  # the streamed chunks come back on the host
    chunks, waited = stream_once(codec, codes, chunking)  # warm-up: every window length once
    sync(device)
    totals, per_push = [], []
    for _ in range(args.repeats):
        # host wall time: a push decodes on the codec's own CUDA stream and returns once its chunk is on the host
        # (Codec.decode_windows_to_host), so events on the default stream would see none of it
        timer = StepTimer(torch.device("cpu"))
        chunks, waited = stream_once(codec, codes, chunking, timer)
        pushes = timer.ms()
        totals.append(sum(pushes))
        per_push.append(pushes)
    streamed = torch.cat(chunks)
    diff = (streamed - whole).abs()
    emitting = [i for i in range(len(per_push[0])) if i + 1 in waited]  # pushes that decoded a window
    first = emitting[0] if emitting else None
    if not graphs:
        codec.graphs = captured  # kept for a later row that asks for them
    graph_rows = {"graphs": "on" if graphs else "off"}
    if graphs:
        kept = [] if codec.graphs is None else codec.graphs.captured
        graph_rows |= {"capture_s": capture_s, "graph_shapes": [f"{b}x{t}" for b, t in kept],
                       "capture_report": {f"{b}x{t}": v for (b, t), v in sorted(report.items())}}  # fmt: skip
    return graph_rows | {
        "ms": median(totals),
        "chunks": len(chunks),
        "chunk_ms": median([per_push[r][i] for r in range(args.repeats) for i in emitting[1:-1]] or [float("nan")]),
        "first_chunk_ms": median([per_push[r][first] for r in range(args.repeats)]) if first is not None else None,
        "first_chunk_after_frames": waited[0],
        "first_chunk_after_ms_audio": waited[0] * 1e3 / codec.frame_rate,
        "left_context": rule.left_context_frames,
        "holdback": rule.holdback_frames,
        "exact": codec.stream(chunking).exact,
        "max_abs_diff": float(diff.max()),
        "max_diff_over_peak": float(diff.max() / whole.abs().max()),
        "rel_err": float((streamed - whole).norm() / whole.norm()),
        "same_length": streamed.shape == whole.shape,
    }


def row_encode(codec: Codec, device: torch.device, args) -> dict:
    g = torch.Generator().manual_seed(1)
    wav = 0.1 * torch.randn(int(args.ref_seconds * codec.sample_rate), generator=g)
    ms, warm = timed(lambda: codec.encode(wav, codec.sample_rate), device, args.repeats)
    return {"ms": median(ms), "warmup_ms": warm, "frames": int(codec.encode(wav, codec.sample_rate).shape[0])}


def run_dtype(name: str, args, device: torch.device, writer: ResultFile) -> None:
    config = TINY_CODEC if args.tiny else HIGGS_V3_CODEC
    need_encoder = "encode" in args.modes
    try:
        t0 = time.perf_counter()
        codec = Codec.from_config(config, encoder=need_encoder, device=device, dtype=DTYPES[name], seed=args.seed)
        build_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - recorded, not raised
        for mode in args.modes:
            writer.add({"dtype": name, "mode": mode, "status": "error", "error": error_text(exc)})
        return
    frames = round(args.seconds * codec.frame_rate)
    g = torch.Generator().manual_seed(args.seed)
    codes = torch.randint(0, codec.codebook_size, (frames, codec.num_quantizers), generator=g)
    for mode in args.modes:
        row = {"dtype": name, "mode": mode, "frames": frames, "audio_s": frames / codec.frame_rate,
               "build_s": build_s, "threads": torch.get_num_threads()}  # fmt: skip
        try:
            if mode == "decode":
                row |= row_decode(codec, codes, device, args)
            elif mode.startswith("stream_"):
                chunking = AudioChunking() if mode.startswith("stream_exact") else UPSTREAM_CHUNKING
                row |= row_stream(codec, codes, chunking, device, args, graphs=mode.endswith("_graphs"))
            else:
                row |= row_encode(codec, device, args)
                row["audio_s"] = args.ref_seconds
            row["ms_per_audio_s"] = row["ms"] / row["audio_s"]
            row["x_realtime"] = 1e3 / row["ms_per_audio_s"]
            row["status"] = "ok"
        except Exception as exc:  # noqa: BLE001
            row |= {"status": "error", "error": error_text(exc)}
        writer.add(row)
        log(f"{name} {mode}: {row.get('ms_per_audio_s', float('nan')):.2f} ms per audio second ({row['status']})")
    del codec
    free_memory(device)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny codec (smoke test) instead of the 4B shape")
    p.add_argument("--quick", action="store_true", help="2 s of audio, 3 repeats, a 2 s reference")
    p.add_argument("--seconds", type=float, default=None, help="audio decoded per call (default 10, quick 2)")
    p.add_argument("--ref-seconds", type=float, default=None, help="reference length encoded (default 10, quick 2)")
    p.add_argument("--dtypes", type=strs_arg, default=list(DTYPES), help="fp32,bf16")
    p.add_argument("--modes", type=strs_arg, default=None, help=",".join(MODES) + " (default: all; on CPU no _graphs)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 10, quick 3)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results)")
    args = p.parse_args(argv)
    cpu = args.device == "cpu" or not torch.cuda.is_available()
    args.modes = args.modes or list(CPU_MODES if cpu else MODES)
    if cpu and any(m.endswith("_graphs") for m in args.modes):
        p.error("the _graphs modes capture CUDA graphs: they need --device cuda")
    bad = [m for m in args.modes if m not in MODES] + [d for d in args.dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown mode(s)/dtype(s) {bad}; modes {list(MODES)}, dtypes {list(DTYPES)}")
    args.seconds = args.seconds or (2.0 if args.quick else 10.0)
    args.ref_seconds = args.ref_seconds or (2.0 if args.quick else 10.0)
    args.repeats = args.repeats or (3 if args.quick else 10)
    return args


def main(argv: Sequence[str] | None = None) -> ResultFile:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = environment(device, "bench_codec.py", argv)
    meta |= {"codec": "tiny" if args.tiny else "4b", "threads": torch.get_num_threads(), "seconds": args.seconds,
             "ref_seconds": args.ref_seconds, "repeats": args.repeats}  # fmt: skip
    writer = ResultFile(args.out, "codec", meta, smoke=args.tiny)
    log(f"writing {writer.path}")
    t0 = time.perf_counter()
    for name in args.dtypes:
        run_dtype(name, args, device, writer)
    writer.meta["wall_s"] = time.perf_counter() - t0
    writer.save()
    columns = ["dtype", "mode", "graphs", "status", "audio_s", "ms", "ms_per_audio_s", "x_realtime", "warmup_ms",
               "chunks", "chunk_ms", "first_chunk_after_ms_audio", "first_chunk_ms", "exact",
               "max_diff_over_peak"]  # fmt: skip
    print_table(writer.rows, columns, title=f"\ncodec ({meta['codec']}) on {device}, {meta['threads']} threads")
    return writer


if __name__ == "__main__":
    main()

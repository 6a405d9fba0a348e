"""The serving path's host cost with the device taken out: a probe for the H200's 16-stream plateau.

On the H200, 16 streams through ``stream_audio`` made 56-61 audio s/s where the engine alone decodes 16 rows in
3.99 ms a step (160 audio s/s; ``h200_20261205c``). This runs the real engine (scheduler, driver thread, async
scheduling), the real ``stream_audio`` threads and the real streaming decoder on the tiny checkpoint, with the two
device parts replaced by stand-ins that take the GPU's time without holding the interpreter lock: a step's rows
are ready ``--step-ms`` after the device is free (random codes, nobody ends early), a codec decode returns silence
after ``--codec-ms`` a call. What is left is the host: if N streams make fewer frames a second than the stand-in
device allows, the host (threads, the interpreter lock, Python per frame and per chunk) is what holds them.

    python benchmarks/probes/serve_host.py --streams 1,16,64 --step-ms 4 --codec-ms 1.5 --out DIR

Rows: per path (``engine``: N requests stepped by one loop, no threads; ``frames``: N threads on ``stream``;
``audio``: N threads on ``stream_audio``) and N, the wall time, audio s/s and the ratio to the stand-in device's
bound (N streams x 25 frames a second at one step per ``--step-ms``), and the share of the wall time the stand-in
device was busy (``device_busy``; ``codec_busy`` its codec part): near 1, the device limits the run (the codec's
time included, which the bound leaves out); well below 1, the host does.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import ResultFile, environment, ints_arg, log, print_table  # noqa: E402

from higgs_talker import HiggsTalker, SamplingParams  # noqa: E402


class StandInDevice:
    """Steps and codec decodes that take the device's time, in order, with the interpreter lock released."""

    def __init__(self, step_s: float, codec_s: float, num_codebooks: int, codes: int) -> None:
        self.step_s, self.codec_s, self.c, self.codes = step_s, codec_s, num_codebooks, codes
        self.free_at = 0.0
        self.busy_s = {"steps": 0.0, "codec": 0.0}  # the device time queued, by kind (``busy`` reads it)
        self.lock = threading.Lock()

    def _queue(self, seconds: float, kind: str) -> float:
        with self.lock:  # one device: work queues behind what was launched before it
            self.free_at = max(self.free_at, time.perf_counter()) + seconds
            self.busy_s[kind] += seconds
            return self.free_at

    def launch(self, batch):
        rows = torch.randint(0, self.codes, (len(batch.slots), self.c), dtype=torch.int32)
        rows = torch.cat([rows, torch.zeros(len(batch.slots), 1, dtype=torch.int32)], dim=1)
        prefill = max(batch.query_lens) > 1
        return _Ready(rows, self._queue(self.step_s * (2 if prefill else 1), "steps"))

    def decode(self, chunks: torch.Tensor, hop: int) -> torch.Tensor:
        _Ready(None, self._queue(self.codec_s, "codec")).wait()
        return torch.zeros(chunks.shape[0], 1, chunks.shape[-1] * hop)


class _Ready:
    def __init__(self, rows, at: float) -> None:
        self.rows, self.at = rows, at

    def wait(self):
        delay = self.at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return self.rows


def build(args) -> tuple[HiggsTalker, StandInDevice]:
    talker = HiggsTalker.from_pretrained("tiny", max_num_seqs=max(args.streams), num_blocks=max(args.streams) * 40)
    cfg = talker.cfg
    device = StandInDevice(args.step_ms / 1e3, args.codec_ms / 1e3, cfg.num_codebooks, cfg.num_real_codes)
    talker.engine._launch = device.launch  # the engine's one seam between its host work and the device
    codec = talker.codec
    codec._decode_batch = lambda chunks: device.decode(chunks, codec.hop_length)
    return talker, device


def run(talker: HiggsTalker, path: str, n: int, frames: int) -> float:
    params = [SamplingParams(seed=i, max_frames=frames, min_frames=frames) for i in range(n)]
    texts = [f"Stream number {i} says hello." for i in range(n)]
    t0 = time.perf_counter()
    if path == "engine":
        for text, p in zip(texts, params, strict=True):
            talker.engine.add_request(talker.build_prompt(text), p)
        ids = list(talker.engine.requests)
        while talker.engine.has_unfinished():
            talker.engine.step()
        wall = time.perf_counter() - t0
        for i in ids:
            talker.engine.pop_finished(i)
        return wall
    consume = talker.stream_audio if path == "audio" else talker.stream
    jobs = zip(texts, params, strict=True)
    threads = [threading.Thread(target=lambda t=t, p=p: [None for _ in consume(t, p)]) for t, p in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> ResultFile:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=ints_arg, default=[1, 16, 64])
    p.add_argument("--paths", default="engine,frames,audio")
    p.add_argument("--step-ms", type=float, default=4.0, help="the stand-in device's decode step (H200, 16 rows: 4)")
    p.add_argument("--codec-ms", type=float, default=1.5, help="the stand-in codec's time a decode call")
    p.add_argument("--frames", type=int, default=250, help="frames a request (25 a second of audio)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each (path, N); the faster is reported")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for this process (Python's default: 5 ms)")  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    torch.set_num_threads(1)
    talker, device = build(args)
    meta = environment(torch.device("cpu"), "probes/serve_host.py", argv)
    meta |= {"step_ms": args.step_ms, "codec_ms": args.codec_ms, "frames": args.frames,
             "switch_interval_s": sys.getswitchinterval()}  # fmt: skip
    out = ResultFile(args.out, "serve_host", meta)
    run(talker, "audio", 2, 40)  # warm: the codec, the threads' first start
    for n in args.streams:
        for path in args.paths.split(","):
            runs = []
            for _ in range(args.repeats):
                before = dict(device.busy_s)
                wall = run(talker, path, n, args.frames)
                runs.append((wall, {k: (v - before[k]) / wall for k, v in device.busy_s.items()}))
            wall, busy = min(runs, key=lambda r: r[0])
            audio_s = n * args.frames / talker.cfg.frame_rate
            bound = n * 1e3 / args.step_ms / talker.cfg.frame_rate  # audio s/s at one step per --step-ms
            rate = audio_s / wall
            row = out.add({"path": path, "streams": n, "wall_s": round(wall, 3), "audio_s_per_s": round(rate, 2),
                           "of_bound": round(rate / bound, 3), "device_busy": round(sum(busy.values()), 3),
                           "codec_busy": round(busy["codec"], 3)})  # fmt: skip
            log(f"{path:6s} N={n:<3d} {row['audio_s_per_s']:8.2f} audio s/s ({row['of_bound']:.0%} of the bound)")
    title = f"host cost of serving, device stood in ({args.step_ms} ms a step, {args.codec_ms} ms a decode)"
    cols = ["path", "streams", "wall_s", "audio_s_per_s", "of_bound", "device_busy", "codec_busy"]
    print_table(out.rows, cols, title)
    print(f"wrote {out.path}")
    return out


if __name__ == "__main__":
    main()

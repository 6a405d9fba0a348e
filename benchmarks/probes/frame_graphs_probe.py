"""Frame graphs (``higgs_talker.cuda_graphs.frame``) on a CUDA device at the 4B head shape: their capture, replay
against the eager frame over 24 steps of a batch whose size changes (40 down to 1 row), and the host time of one
step's frame work, eager against replayed, at 1 and 16 rows (p50 of 35 steps, the device idle before each).

    PYTHONPATH=$PWD python3 benchmarks/probes/frame_graphs_probe.py
"""

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

from higgs_talker.cuda_graphs.frame import FrameGraphs
from higgs_talker.heads.slots import RequestSlots, SlotStore
from higgs_talker.heads.spans import frame_results

dev = torch.device("cuda")
C, V, H = 8, 1026, 2560
AUDIO, EOS = 151671, 151645  # text tokens; any two ids do
frame = functools.partial(frame_results, audio_id=AUDIO, eos_id=EOS)


class Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, h):
        return torch.nn.functional.linear(h, self.weight).view(h.shape[0], C, V)


def mk():
    return RequestSlots(SlotStore(64, C, V, 1024, 1025, dev), seed=3)


def batch(slots, ids, step):
    s, _ = slots.sync(ids)
    b = len(ids)
    g = torch.Generator(device=dev).manual_seed(100 + step)
    hidden = (torch.randn(b, H, generator=g, device=dev) * 3).to(torch.bfloat16)
    tail_ids = torch.full((b,), AUDIO, device=dev)  # new requests open a stream, the others are due a frame
    streaming = slots.store.state.has_codes.index_select(0, s)
    tail_pos = torch.where(streaming, slots.seed_pos.index_select(0, s) + slots.store.num_rows.index_select(0, s), 5)
    params = (torch.ones(b, device=dev), torch.full((b,), 50, device=dev), torch.full((b,), 0.95, device=dev))
    return s, hidden, tail_ids, tail_pos, params


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe (CUDA graphs): no CUDA device here")
    head = Head(torch.randn(C * V, H, device=dev, dtype=torch.bfloat16) * 0.02)
    cfg = type("Cfg", (), {"higgs_frame_graphs": True})()
    graphed, eager = mk(), mk()
    t0 = time.perf_counter()
    graphs = FrameGraphs.if_asked(cfg, frame, graphed, head, 64, AUDIO)
    print(f"captured {graphs.sizes} failed {graphs.failed} in {time.perf_counter() - t0:.2f} s")
    ids = [f"r{i}" for i in range(40)]
    bad = 0
    for step in range(24):
        n = [40, 33, 16, 9, 3, 1][step % 6]
        got = graphs.run(*batch(graphed, ids[:n], step))
        want = frame(eager, head, *batch(eager, ids[:n], step))
        bad += 0 if torch.equal(got, want) else 1
    print(f"replay vs eager over 24 steps (batches 40..1): {bad} steps differ; replays {graphs.replays}")
    for b in (1, 16):
        sl = mk()
        fg = FrameGraphs.if_asked(cfg, frame, sl, head, 64, AUDIO)
        ids = [f"q{i}" for i in range(b)]

        def eager_step(a, sl=sl):
            return frame(sl, head, *a)

        def graph_step(a, fg=fg):
            return fg.run(*a)

        for label, fn in (("eager", eager_step), ("graph", graph_step)):
            times = []
            for step in range(40):
                a = batch(sl, ids, step)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(a)
                times.append((time.perf_counter() - t0) * 1e3)
            times = sorted(times[5:])
            torch.cuda.synchronize()
            print(f"b={b} {label}: host ms p50 {times[len(times) // 2]:.3f}")


if __name__ == "__main__":
    main()

"""Where does the vLLM adapter's sample path wait for the GPU? Its pieces (SpanStep.text_logits + sample on
RequestSlots, as HiggsTalkerForConditionalGeneration.sample calls them) on CUDA at the 4B head shape, with torch's
sync debug mode raising at the first synchronizing call after warm-up; then host time per step with and without a
long GPU op queued ahead (a sync shows as host time that grows with the queue).

    PYTHONPATH=$PWD python3 benchmarks/probes/sample_path_syncs.py
"""

import argparse
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from higgs_talker.heads.sampling import row_params
from higgs_talker.heads.slots import RequestSlots, SlotStore
from higgs_talker.heads.spans import SpanStep

dev = torch.device("cuda")
C, V, H, VOCAB = 8, 1026, 2560, 151936
AUDIO, EOS = 151669, 151643


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe (torch's CUDA sync debug mode): no CUDA device here")
    store = SlotStore(64, C, V, 1024, 1025, dev)
    slots = RequestSlots(store, seed=0)
    head_w = torch.randn(C * V, H, device=dev, dtype=torch.bfloat16) * 0.02
    head = lambda h: torch.nn.functional.linear(h, head_w).view(h.shape[0], C, V)  # noqa: E731
    text_head = lambda h: torch.zeros(h.shape[0], VOCAB, device=dev, dtype=h.dtype)  # noqa: E731
    specials = SimpleNamespace(audio=AUDIO, eos=EOS)
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mode = [0]

    def step(ids, pos, gens, b):
        torch.cuda.set_sync_debug_mode(0)
        slots.settle()  # as make_omni_output does before compute_logits
        ids_d = torch.tensor(ids).to(dev, non_blocking=True)
        pos_d = torch.tensor(pos).to(dev, non_blocking=True)
        torch.cuda.set_sync_debug_mode(mode[0])
        s = SpanStep([f"r{i}" for i in range(b)])
        s.lay_out(slots, ids_d, pos_d, torch.arange(b + 1, device=dev))
        hidden = torch.randn(b, H, device=dev, dtype=torch.bfloat16)
        s.text_logits(slots, hidden, specials, text_head, VOCAB)
        t0 = time.perf_counter()
        s.adopt_seeds(slots, {i: g.initial_seed() for i, g in gens.items()})
        forced = slots.all_forced(s.req_ids) or bool(s.modes.audio.all())
        t = torch.ones(b, device=dev)
        k = torch.full((b,), 50, device=dev, dtype=torch.long)
        p = torch.full((b,), 0.95, device=dev)
        s.sample(slots, head, row_params(b, dev, t, k, p))
        s.modes.forced.to(torch.int32)[:, None]  # the forced text tokens handed to vLLM
        t1 = time.perf_counter()
        return forced, (t1 - t0) * 1e3

    for b in (1, 16):
        gens = {i: torch.Generator(device=dev).manual_seed(100 + i) for i in range(b)}
        pos = [5] * b
        step([AUDIO] * b, pos, gens, b)  # the seed step
        for _ in range(6):  # warm-up: each fused kernel checks its first signature (a sync, once)
            pos = [x + 1 for x in pos]
            step([AUDIO] * b, pos, gens, b)
            slots.settle()
        torch.cuda.synchronize()
        mode[0] = "error"
        try:
            for _ in range(3):
                pos = [x + 1 for x in pos]
                forced, ms = step([AUDIO] * b, pos, gens, b)
            print(f"b={b}: no synchronizing call in 3 steps (forced={forced})")
        except RuntimeError:
            print(f"b={b}: a synchronizing call:")
            traceback.print_exc()
        mode[0] = 0
        torch.cuda.set_sync_debug_mode(0)
        for queued in (False, True):
            times = []
            for _ in range(20):
                torch.cuda.synchronize()
                if queued:
                    for _ in range(20):
                        big @ big  # ~ several ms of GPU work queued ahead
                pos = [x + 1 for x in pos]
                times.append(step([AUDIO] * b, pos, gens, b)[1])
            times.sort()
            print(f"b={b} queued={queued}: sample-path host ms p50 {times[10]:.3f} min {times[0]:.3f}")
        slots.release([f"r{i}" for i in range(b)])


if __name__ == "__main__":
    main()

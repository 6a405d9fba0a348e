"""Where a warm ``HiggsTalker.from_pretrained`` of a checkpoint spends its time (CUDA): the checkpoint's files read
twice (``cat``: is it in the page cache?), its tensors read raw with safetensors straight to the GPU and through the
CPU, ``import higgs_talker``, then ``from_pretrained`` under cProfile (the 60 largest cumulative and 30 largest own
times). Run it after a start that filled the caches (FlashInfer, Triton, choices), e.g. after bench_coldstart.

    python benchmarks/probes/load_profile.py /tmp/higgs_4b_random > load_profile.log
"""

import argparse
import cProfile
import logging
import pstats
import subprocess
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default="/tmp/higgs_4b_random", help="checkpoint directory")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe (weights loaded to the GPU): no CUDA device here")
    files = sorted(str(f) for f in Path(args.path).glob("*.safetensors"))
    if not files:
        sys.exit(f"{Path(__file__).name}: no *.safetensors in {args.path}")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    for rep in range(2):
        t = time.perf_counter()
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # no shell: the path is data
        print(f"cat files #{rep}: {time.perf_counter() - t:.2f} s")
    from safetensors import safe_open

    torch.zeros(1, device="cuda")
    for dev in ("cuda", "cpu"):
        t, n = time.perf_counter(), 0
        for f in files:
            with safe_open(f, "pt", device=dev) as h:
                for k in h.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    x = h.get_tensor(k)
                    if dev == "cpu":
                        x = x.to("cuda")
                    n += x.numel() * x.element_size()
        torch.cuda.synchronize()
        print(f"raw safetensors device={dev}: {time.perf_counter() - t:.2f} s, {n / 1e9:.2f} GB")
    t = time.perf_counter()
    from higgs_talker import HiggsTalker

    print(f"import higgs_talker {time.perf_counter() - t:.2f} s")
    profile, t = cProfile.Profile(), time.perf_counter()
    profile.enable()
    HiggsTalker.from_pretrained(args.path, device="cuda")
    torch.cuda.synchronize()
    profile.disable()
    print(f"from_pretrained {time.perf_counter() - t:.2f} s")
    pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(60)
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()

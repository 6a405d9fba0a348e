"""Summarise a py-spy ``--gil -f raw`` profile (collapsed stacks: ``frame;frame;... count`` a line): the share of
the samples in stacks that pass through ``--through`` (default: any thread started with ``threading``, i.e. the
serving threads, not the build or the imports of the main thread), by frame inclusive and by the innermost frame.
With ``--gil``, py-spy samples only the thread holding the interpreter lock, so the shares say where a host-bound
run spends the lock.

    py-spy record --gil -r 200 -f raw -o gil.txt -- python benchmarks/bench_serve.py --paths frames --levels 64 ...
    python benchmarks/probes/gil_summary.py gil.txt [--through Driver._loop] [--top 40]
"""

from __future__ import annotations

import argparse
import lzma
from collections import Counter
from pathlib import Path


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    """(frames outermost first, samples) of each line; ``.xz`` files are read compressed."""
    opener = lzma.open if path.suffix == ".xz" else open
    stacks = []
    with opener(path, "rt") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if stack and count.isdigit():
                stacks.append((stack.split(";"), int(count)))
    return stacks


def summarise(stacks: list[tuple[list[str], int]], through: str) -> tuple[int, int, Counter, Counter]:
    """(all samples, samples through ``through``, inclusive counts by frame, counts by innermost frame)."""
    total = sum(n for _, n in stacks)
    kept = [(frames, n) for frames, n in stacks if any(through in f for f in frames)]
    inclusive, own = Counter(), Counter()
    for frames, n in kept:
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return total, sum(n for _, n in kept), inclusive, own


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--through", default="Thread._bootstrap", help="keep stacks with a frame containing this")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    total, kept, inclusive, own = summarise(read_stacks(args.profile), args.through)
    print(f"{kept} of {total} samples pass through {args.through!r}")
    for title, counts in (("inclusive", inclusive), ("innermost", own)):
        print(f"\n{title}:")
        for frame, n in counts.most_common(args.top):
            print(f"{n / max(kept, 1):7.1%}  {frame}")


if __name__ == "__main__":
    main()

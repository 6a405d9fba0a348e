"""Who first imports a heavy module during ``HiggsTalker.from_pretrained``: an import hook prints, for each watched
module, the seconds since start and the stack (our frames and the library's) of its first import. Run it where a
warm start is slow, with the checkpoint in the page cache; ``bench_coldstart``'s ``heavy_imports`` says whether a
start still imports them.

    python benchmarks/probes/import_trace.py /tmp/higgs_4b_random --device cuda
    python benchmarks/probes/import_trace.py tiny --device cpu --watch torch._dynamo,sympy,transformers.modeling_utils
"""

import argparse
import importlib.abc
import sys
import time
import traceback

WATCH = "torch._dynamo,sympy,transformers,transformers.models.auto.modeling_auto"


class FirstImport(importlib.abc.MetaPathFinder):
    """Prints where each watched module is first imported; finds nothing itself."""

    def __init__(self, names: set[str], start: float, depth: int) -> None:
        self.names, self.start, self.depth = names, start, depth

    def find_spec(self, name, path, target=None):
        if name in self.names:
            self.names.discard(name)
            print(f"=== {name}: first imported {time.perf_counter() - self.start:.2f} s after start", flush=True)
            stack = [f for f in traceback.extract_stack()[:-1] if "importlib._bootstrap" not in f.filename]
            for frame in stack[-self.depth :]:
                print(f"    {frame.filename}:{frame.lineno} {frame.name}: {frame.line}")
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", default="tiny")
    p.add_argument("--device", default="cuda")
    p.add_argument("--watch", default=WATCH, help=f"comma-separated module names (default {WATCH})")
    p.add_argument("--depth", type=int, default=14, help="stack frames shown per module")
    args = p.parse_args()
    start = time.perf_counter()
    sys.meta_path.insert(0, FirstImport(set(args.watch.split(",")), start, args.depth))
    from higgs_talker import HiggsTalker

    print(f"import higgs_talker: {time.perf_counter() - start:.2f} s", flush=True)
    HiggsTalker.from_pretrained(args.checkpoint, device=args.device)
    print(f"loaded: {time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()

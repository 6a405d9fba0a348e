"""CPU probe: the host time of the adapter's runner entry points a decode step of N requests in their streams,
outside the frame work (which the frame graphs replay in one launch on a GPU). The adapter is built as
``tests/vllm_plugin/test_adapter.py`` builds it (the tiny checkpoint, a real vLLM config, float32) and driven by its
``Driver`` in vllm-omni's runner order, past the delay ramp. On CPU every tensor op runs inline, so the figures are
Python plus small tensor work; on a GPU the same calls are Python plus launches. Prints; asserts nothing.

    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/probes/runner_host_time.py [N ...]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import sys
import time
from pathlib import Path

ENTRY_POINTS = ("update_decode_step_metadata", "make_omni_output", "compute_logits", "sample")


def host_time(model, driver_cls, ramp: int, batch: int, steps: int) -> dict[str, float]:
    """Microseconds a step in each entry point (``sample`` less the frame work) and in the frame work."""
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0

        return wrapper

    saved = {name: getattr(model, name) for name in (*ENTRY_POINTS, "frame")}
    own = {name for name in saved if name in vars(model)}  # set on the instance (frame); the rest are methods
    try:
        for name, fn in saved.items():
            setattr(model, name, timed(name, fn))
        driver, ids = driver_cls(model), [f"ops{batch}_{i}" for i in range(batch)]  # ids whose rows stay in audio
        for _ in range(ramp + 2):
            driver.step(ids)
        spent.clear()
        for _ in range(steps):
            driver.step(ids)
        driver.finish(set(ids))
    finally:
        for name, fn in saved.items():
            if name in own:
                setattr(model, name, fn)
            else:
                delattr(model, name)  # the class's method shows through again
    spent["sample"] -= spent["frame"]
    return {name: spent[name] / steps * 1e6 for name in (*ENTRY_POINTS, "frame")}


def main(batches: list[int], steps: int) -> None:
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "tests" / "vllm_plugin"), str(root / "tests")]
    import test_adapter

    from higgs_talker.tiny import tiny_checkpoint

    model = test_adapter.build_adapter(tiny_checkpoint(), max_num_seqs=max(batches))
    print(f"{'requests':>8s} " + " ".join(f"{n:>28s}" for n in ENTRY_POINTS) + f" {'outside the frame':>18s}"
          f" {'frame (CPU)':>12s}   us a step")  # fmt: skip
    for batch in batches:
        t = host_time(model, test_adapter.Driver, test_adapter.N_RAMP, batch, steps)
        outside = sum(t[n] for n in ENTRY_POINTS)
        print(f"{batch:8d} " + " ".join(f"{t[n]:28.0f}" for n in ENTRY_POINTS) + f" {outside:18.0f} {t['frame']:12.0f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("batches", nargs="*", type=int, default=[1, 8, 64], help="requests a step (default 1 8 64)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per batch (default 20)")
    args = p.parse_args()
    if importlib.util.find_spec("vllm") is None:
        sys.exit(f"{Path(__file__).name} drives the vLLM adapter: vllm is not installed (pip install -e '.[vllm]')")
    main(args.batches, args.steps)

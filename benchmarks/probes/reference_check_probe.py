"""H200 probe: the reference check's failure on the medium auto talker with the deploy sampling, in full, then the
4B shape's errors (correct and o_proj x 1.25). Prints everything; asserts nothing.

    PYTHONPATH=$PWD python benchmarks/probes/reference_check_probe.py
"""

import argparse
import sys
import traceback
from pathlib import Path

import torch


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe (the CUDA tests' talkers): no CUDA device here")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import test_gpu as t
    from _reference_check import ScoreBound, float32_reference

    from higgs_talker import SamplingParams

    auto, eager = t._talker("auto"), t._talker("eager")
    ref = float32_reference(eager)
    for name, talker in (("auto", auto), ("eager", eager)):
        for label, params in (("greedy", None), ("deploy", t.DEPLOY)):
            try:
                c = t._check_schedule(talker, ref, 13, params)
                print(f"[probe] medium {name} {label}: ok, row {c.worst_row:.4g} overall {c.overall:.4g}", flush=True)
            except Exception:
                print(f"[probe] medium {name} {label}: FAILED", flush=True)
                traceback.print_exc()
                sys.stdout.flush()
    del auto, eager, ref
    four = t.four_b_talker()
    ref = float32_reference(four)
    inf = ScoreBound(row=float("inf"), overall=float("inf"), code=float("inf"))
    greedy = SamplingParams(temperature=0, max_frames=40)
    c = t._check_schedule(four, ref, 4, greedy, inf)
    print(f"[probe] 4b greedy correct: row {c.worst_row:.4g} overall {c.overall:.4g}", flush=True)
    b = t._check_schedule(t.break_projection(four, "o_proj", 17, 1.25), ref, 4, greedy, inf)
    print(f"[probe] 4b greedy o_proj x 1.25: row {b.worst_row:.4g} overall {b.overall:.4g}", flush=True)


if __name__ == "__main__":
    main()

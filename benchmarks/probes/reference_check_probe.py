"""H200 probe: the reference check's failure on the medium auto talker with the deploy sampling, in full, then the
4B shape's errors (correct and o_proj x 1.25). Prints everything; asserts nothing."""

import sys
import traceback

sys.path.insert(0, "tests")
import test_gpu as t  # noqa: E402
from _reference_check import ScoreBound, float32_reference  # noqa: E402

from higgs_talker import SamplingParams  # noqa: E402

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

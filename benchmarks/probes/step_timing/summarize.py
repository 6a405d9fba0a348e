"""Markdown tables from the step-timing probe's summaries (``steps_<pid>.json`` in DIR; see ``higgs_step_timing``).

    python benchmarks/probes/step_timing/summarize.py DIR

Per process that ran steps: one row per category (kind x batch size) with the step interval, our entry points'
host time, the probe's own time and the remainder (interval - ours - probe: vLLM / vllm-omni's runner and
scheduler), p50 (p90) in microseconds, and the CUDA spans where there are any; then each entry point's mean
microseconds per step (zeros included, so they add up to "our code") with its calls per step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KIND_ORDER = {"decode": 0, "replayed": 1, "prefill": 2, "other": 3}


def order(category: str) -> tuple[int, int]:
    """decode before replayed before prefill before other; by batch size within a kind."""
    kind, _, batch = category.partition(" b=")
    return KIND_ORDER.get(kind, 9), int(batch.split("-")[0]) if batch else 0


def cell(stats: dict, p90: bool = True) -> str:
    if not stats.get("n"):
        return "-"
    return f"{stats['p50']:.0f} ({stats['p90']:.0f})" if p90 else f"{stats['p50']:.0f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def process_section(data: dict) -> str:
    classes = ", ".join(c.rsplit(":", 1)[-1] for c in data["classes"])
    state = "final" if data["final"] else "NOT final (killed before its exit hook: the last steps are missing)"
    head = (f"## pid {data['pid']} ({data['process']}, parent {data['ppid']}): {classes}; {data['instances']} "
            f"instance(s); {state}; {'CUDA' if data['cuda'] else 'no CUDA spans'}\n\n"
            f"{data['steps']} steps ({data['real_steps']} real, {data['idle_gaps']} idle gaps over "
            f"{data['settings']['idle_s']} s not timed"
            + (f", {data['cuda_pending']} CUDA spans not yet read" if data["cuda_pending"] else "")
            + "); microseconds per step, p50 (p90); remainder = interval - our code - probe")  # fmt: skip
    cats = sorted(data["categories"], key=order)
    rows = []
    for name in cats:
        c = data["categories"][name]
        sizes = " ".join(f"{b}:{n}" for b, n in c["batch_sizes"].items())
        rows.append([name, str(c["steps"]), sizes, cell(c["interval_us"]), cell(c["ours_us"]),
                     cell(c["probe_us"], p90=False), cell(c["remainder_us"]), cell(c["forward_cuda_us"]),
                     cell(c["step_cuda_us"]), str(c["python_forward_steps"])])  # fmt: skip
    steps = table(["category", "steps", "batch:steps", "interval", "our code", "probe", "remainder", "forward CUDA",
                   "step CUDA", "Python forward"], rows)  # fmt: skip
    methods = sorted({m for name in cats for m in data["categories"][name]["methods"]})
    mrows = []
    for m in methods:
        row = [m]
        for name in cats:
            c = data["categories"][name]
            got = c["methods"].get(m)
            row.append(f"{got['mean_us']:.0f} ({got['calls'] / c['steps']:.2g})" if got else "-")
        mrows.append(row)
    for label, key in (("**our code**", "ours_us"), ("**interval**", "interval_us")):
        means = [data["categories"][name][key].get("mean") for name in cats]
        mrows.append([label] + ["-" if m is None else f"{m:.0f}" for m in means])
    per_method = table(["entry point: mean us per step (calls per step)", *cats], mrows)
    return f"{head}\n\n{steps}\n\n{per_method}\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    files = sorted(Path(argv[0]).glob("steps_*.json"))
    if not files:
        print(f"no steps_*.json in {argv[0]}", file=sys.stderr)
        return 1
    for path in files:
        print(process_section(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

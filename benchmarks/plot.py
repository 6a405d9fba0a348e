"""Turn benchmark JSONs into PNGs: ms/step vs batch per mode (and sampling) with the floor, TTFP/RTF vs
concurrency, attention microseconds vs context, and for the speech paths (``serve_``: our server over HTTP and the
direct API; ``omni_``: vllm-omni's pipeline, ours and upstream's talker) TTFA, RTF and audio seconds per second vs
concurrency. Needs matplotlib (``pip install -e '.[bench]'``); without it
the script says so and exits with status 1.

    python benchmarks/plot.py                       # the newest JSON of each kind under benchmarks/results
    python benchmarks/plot.py a.json b.json --out DIR

"Newest" goes by the time a result was measured, not the file's modification time (a fresh clone gives every
file the same one): the ``YYYYMMDD-HHMMSS`` stamp the scripts put in the file name, else the JSON's
``meta.date``; ``results/`` and every folder below it are searched.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
KINDS = ("decode", "e2e", "attention", "serve", "omni")


def kind_of(data: dict, path: Path) -> str | None:
    rows = data.get("rows") or [{}]
    keys = set().union(*(r.keys() for r in rows))
    if "variant" in keys:
        return "attention"
    if "talker" in keys:
        return "omni"
    if "chunking" in keys:
        return "serve"
    if "concurrency" in keys:
        return "e2e"
    if "ms_per_step" in keys or "mode" in keys:
        return "decode"
    prefix = path.name.split("_", 1)[0]
    return prefix if prefix in KINDS else None


STAMP = re.compile(r"(\d{8}-\d{6})")


def measured_at(path: Path) -> str:
    """When a result was measured, as ``YYYYMMDD-HHMMSS``: the stamp in its file name, else its ``meta.date``;
    "" when neither is there (such a file sorts oldest)."""
    found = STAMP.findall(path.name)
    if found:
        return found[-1]
    try:
        date = json.loads(path.read_text())["meta"]["date"]
        return _dt.datetime.fromisoformat(str(date)).strftime("%Y%m%d-%H%M%S")
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def newest(results: Path) -> list[Path]:
    """The newest ``KIND_*.json`` of each kind anywhere under ``results`` (see ``measured_at``)."""
    out = []
    for kind in KINDS:
        files = sorted(results.rglob(f"{kind}_*.json"), key=lambda p: (measured_at(p), str(p)))
        if files:
            out.append(files[-1])
    return out


def title(data: dict, what: str) -> str:
    m = data.get("meta", {})
    gpu = (m.get("gpu") or m.get("device") or "?").split(" (")[0]
    return f"{what} - {gpu}, torch {m.get('torch')}, flashinfer {m.get('flashinfer')}, {str(m.get('date'))[:10]}"


def series(row: dict) -> str:
    """A line's label: the mode, and the sampling where the result has one (older results do not)."""
    return row["mode"] + (f" {row['sampling']}" if row.get("sampling") else "")


def plot_decode(plt, data: dict, png: Path) -> Path:
    rows = [r for r in data["rows"] if r.get("status") == "ok"]
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(contexts)), figsize=(6.5 * max(1, len(contexts)), 4.8), squeeze=False)
    for ax, ctx in zip(axes[0], contexts, strict=False):
        here = [r for r in rows if r["context"] == ctx]
        for name in dict.fromkeys(series(r) for r in here):
            pts = sorted((r["batch"], r["ms_per_step"]) for r in here if series(r) == name)
            style = "s--" if name.startswith("hf_") else "o-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name, markersize=4)
        floor = {}
        for r in here:
            if not r["mode"].startswith("hf_"):
                floor[r["batch"]] = r["floor_ms"]
        if floor:
            xs = sorted(floor)
            ax.plot(xs, [floor[x] for x in xs], "k:", linewidth=2, label="HBM floor")
        ax.set_xlabel("batch (requests decoding)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"context {ctx}")
        _finish_axes(ax, [r["batch"] for r in here])
    fig.suptitle(title(data, "decode step"), fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def plot_e2e(plt, data: dict, png: Path) -> Path:
    rows = [r for r in data["rows"] if r.get("status") == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for metric, ax, label in (("ttfp_ms", axes[0], "TTFP (ms)"), ("rtf", axes[1], "RTF (wall / audio)")):
        for name in dict.fromkeys(series(r) for r in rows):
            here = sorted((r for r in rows if series(r) == name), key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in here]
            for q, style in (("p50", "o-"), ("p90", "^--"), ("p99", "v:")):
                ax.plot(xs, [r[f"{metric}_{q}"] for r in here], style, label=f"{name} {q}", markersize=4)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        _finish_axes(ax, [r["concurrency"] for r in rows], log_y=False)
    axes[1].axhline(1.0, color="k", linewidth=0.8)
    fig.suptitle(title(data, "end to end"), fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def plot_attention(plt, data: dict, png: Path) -> Path:
    rows = [r for r in data["rows"] if r.get("us_per_call") is not None]
    core = [r for r in rows if r["page_size"] == 16 and r["layout"] == "NHD" and r.get("group") != "multiblock"]
    batches = sorted({r["batch"] for r in core}) or [1]
    cols = max(len(batches), 2)
    fig, axes = plt.subplots(3, cols, figsize=(4.6 * cols, 12.6), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=False):
        here = [r for r in core if r["batch"] == b]
        for var in dict.fromkeys(r["variant"] for r in here):
            # one point per context (a variant timed in two groups keeps its first, i.e. core, row)
            per_ctx = {}
            for r in here:
                if r["variant"] == var:
                    per_ctx.setdefault(r["context"], r)
            pts = sorted(per_ctx.items())
            line = ax.plot([c for c, _ in pts], [r["us_per_call"] for _, r in pts], "o-", label=var, markersize=3)
            bad = [(c, r["us_per_call"]) for c, r in pts if r.get("status") == "wrong"]
            if bad:  # timed, but the output was wrong: a time that must not be read as a result
                ax.plot([c for c, _ in bad], [t for _, t in bad], "x", color=line[0].get_color(), markersize=9,
                        label=f"{var}: wrong output")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"batch {b}, page 16, NHD")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("us per call (graph replay)")
        _finish_axes(ax, [r["context"] for r in here])
    # XQA / native time ratio per (page, layout)
    by: dict[tuple, dict] = {}
    for r in rows:  # first row per key: core before the extra groups that repeat a variant
        by.setdefault((r["variant"], r["batch"], r["context"], r["page_size"], r["layout"]), r)
    for ax, b in zip(axes[1], batches, strict=False):
        combos = sorted({(r["page_size"], r["layout"]) for r in rows if r["batch"] == b})
        for page, layout in combos:
            pts = []
            for (var, bb, ctx, p, lay), r in sorted(by.items(), key=lambda kv: kv[0][2]):
                nat = by.get(("fi_native", bb, ctx, p, lay))
                if var == "xqa_own" and bb == b and p == page and lay == layout and nat:
                    pts.append((ctx, r["us_per_call"] / nat["us_per_call"]))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"page {page} {layout}", markersize=3)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}: xqa_own / fi_native time")
        ax.set_xlabel("context (tokens)")
        _finish_axes(ax, [r["context"] for r in rows if r["batch"] == b], log_y=False)
    # multi-block and the extra variants, as time ratios to their baseline (page 16, NHD)
    pairs = ((axes[2][0], "xqa_1block", "xqa_own", "XQA multi-block off / on"),
             (axes[2][1], "xqa_wide", "xqa_own", "wide table / tight, and tensor-core / CUDA-core native"))  # fmt: skip
    for ax, var, base, name in pairs:
        extra = [("fi_native_tc", "fi_native")] if var == "xqa_wide" else []
        for v, bl in [(var, base), *extra]:
            for b in sorted({r["batch"] for r in rows if r["variant"] == v}):
                keys = [k for k in by if k[0] == v and k[1] == b and k[3:] == (16, "NHD") and (bl, *k[1:]) in by]
                pts = sorted((k[2], by[k]["us_per_call"] / by[(bl, *k[1:])]["us_per_call"]) for k in keys)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{v}/{bl} b={b}", markersize=3)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("context (tokens)")
        _finish_axes(ax, [r["context"] for r in rows], log_y=False)
    for ax in axes[2][2:]:
        ax.set_visible(False)
    fig.suptitle(title(data, "attention decode, 32/8 heads, d=128, bf16"), fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def _finish_axes(ax, xs: list, log_y: bool = True) -> None:
    """Log axes with plain-number ticks at the measured x values, a grid, a legend if anything is labelled."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_xscale("log", base=2)
    ticks = sorted(set(xs))
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks], fontsize=7)
        ax.xaxis.set_minor_formatter(NullFormatter())
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


SPEECH_SERIES = {"serve": ("path", "chunking", "sampling"), "omni": ("talker", "profile", "path")}


def plot_speech(kind: str):
    """The plotter of a speech benchmark (``serve`` or ``omni``): one line per configuration (the row keys of
    ``SPEECH_SERIES``), TTFA p50 (p90 dashed), RTF p50 and audio seconds per second against concurrency."""
    keys = SPEECH_SERIES[kind]
    what = {"serve": "speech server vs direct API", "omni": "vllm-omni pipeline"}[kind]

    def plot(plt, data: dict, png: Path) -> Path:
        rows = [r for r in data["rows"] if r.get("status") == "ok" and r.get("concurrency") is not None]
        if not rows:
            raise ValueError("no finished level to plot")
        fig, (ttfa, rtf, rate) = plt.subplots(1, 3, figsize=(16, 4.6))
        for label in dict.fromkeys(" ".join(str(r.get(k)) for k in keys) for r in rows):
            here = sorted((r for r in rows if " ".join(str(r.get(k)) for k in keys) == label),
                          key=lambda r: r["concurrency"])  # fmt: skip
            xs = [r["concurrency"] for r in here]
            ys = {m: [float("nan") if r.get(m) is None else r[m] for r in here]
                  for m in ("ttfa_ms_p50", "ttfa_ms_p90", "rtf_p50", "audio_s_per_s")}  # fmt: skip
            (line,) = ttfa.plot(xs, ys["ttfa_ms_p50"], "o-", label=label, markersize=4)
            ttfa.plot(xs, ys["ttfa_ms_p90"], "^--", color=line.get_color(), markersize=3)
            rtf.plot(xs, ys["rtf_p50"], "o-", color=line.get_color(), label=label, markersize=4)
            rate.plot(xs, ys["audio_s_per_s"], "o-", color=line.get_color(), label=label, markersize=4)
        labels = ("time to first audio (ms; p90 dashed)", "RTF p50 (wall / audio)", "audio seconds per second")
        for ax, ylabel in zip((ttfa, rtf, rate), labels, strict=True):
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(ylabel)
            _finish_axes(ax, [r["concurrency"] for r in rows], log_y=ax is not rtf)
        fig.suptitle(title(data, what), fontsize=10)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        plt.close(fig)
        return png

    return plot


PLOTTERS = {"decode": plot_decode, "e2e": plot_e2e, "attention": plot_attention, "serve": plot_speech("serve"),
            "omni": plot_speech("omni")}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", type=Path, help="JSON files (default: the newest of each kind)")
    p.add_argument(
        "--results", type=Path, default=RESULTS_DIR, help="where to look (with its subfolders) for the newest JSONs"
    )
    p.add_argument("--out", type=Path, default=None, help="PNG directory (default: next to each JSON)")
    args = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "plot.py: matplotlib is not installed; no PNGs written (pip install -e '.[bench]' in the checkout)"
        ) from None
    files = args.files or newest(args.results)
    if not files:
        raise SystemExit(f"plot.py: no benchmark JSON found under {args.results}")
    written = []
    for path in files:
        data = json.loads(path.read_text())
        kind = kind_of(data, path)
        if kind is None:
            print(f"plot.py: {path}: not a benchmark result, skipped", file=sys.stderr)
            continue
        out_dir = args.out or path.parent
        out_dir.mkdir(parents=True, exist_ok=True)
        png = out_dir / (path.stem + ".png")
        try:
            written.append(PLOTTERS[kind](plt, data, png))
            print(f"wrote {png}")
        except Exception as exc:  # noqa: BLE001 - one bad file must not stop the others
            print(f"plot.py: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()

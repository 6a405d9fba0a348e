"""Where a request's time went inside vllm-omni's pipeline, per talker and concurrency level of a ``bench_omni.py``
HTTP run, read from the per-request tables ``vllm-omni serve`` logs (``StageRequestStats``: Stage 0's time to the
first row and time per decode step, Stage 1's time to its first audio and between its chunks).

    python benchmarks/omni_stage_stats.py RUN.json SERVER_LOG [SERVER_LOG ...] [--out DIR]

``SERVER_LOG``: ``bench_omni.py``'s ``server_<talker>_<profile>.log`` (in its ``--out`` directory), or a ``.tar.xz``
holding them. A server's timed requests are those with the most Stage-0 rows (the warm-up waves are shorter); they
finished level by level, so the run's rows (concurrency, requests) assign them in order (requests beyond them: a
level cut before its row was written). ``--out``: also write the table as ``<run>_stages.json`` there. This reads
what vllm-omni measured; it times nothing itself.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tarfile
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
HEADER = re.compile(r"\[StageRequestStats \[request_id=([^\]]+)\]\]")
E2E_HEADER = re.compile(r"\[RequestE2EStats \[request_id=([^\]]+)\]\]")
PAIR = re.compile(r"\|\s*(\w+)\s*\|\s*([^|]*?)\s*\|\s*$")
ROW = re.compile(r"\|\s*(\w+)\s*\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|\s*$")
# (column, stage, field, scale): what the table shows of each request, per stage
COLUMNS = (
    ("s0_first_row_ms", 0, "vllm_ttft_ms", 1.0),
    ("s0_step_ms", 0, "vllm_tpot_ms", 1.0),
    ("s0_gen_s", 0, "stage_gen_time_ms", 1e-3),
    ("s1_first_audio_ms", 1, "serving_time_to_first_output_ms", 1.0),
    ("s1_chunk_gap_ms", 1, "inter_output_latency_ms", 1.0),
    ("s1_gen_s", 1, "stage_gen_time_ms", 1e-3),
    ("s1_audio_s", 1, "audio_duration_s", 1.0),
    ("e2e_ms", 0, "e2e_total_ms", 1.0),
)


def _number(cell: str) -> float | None:
    """``"4.187 (n=57)"`` -> 4.187, ``"22,080"`` -> 22080.0; None where the cell holds no number."""
    m = re.match(r"-?[\d,]*\.?\d+", cell)
    return float(m.group(0).replace(",", "")) if m else None


def stage_tables(text: str) -> list[dict[str, tuple]]:
    """Every request's ``StageRequestStats`` table of a server log, in log order: {field: (stage 0, stage 1)}, with
    ``e2e_total_ms`` from the request's ``RequestE2EStats`` table (logged just before it) as (value, None). Each log
    line carries the logger's prefix; a table ends at the first line after its header that is not a table line."""
    tables: list[dict[str, tuple]] = []
    e2e: dict[str, float | None] = {}
    current, current_e2e = None, None
    for line in ANSI.sub("", text).splitlines():
        if header := HEADER.search(line):
            current, current_e2e = {"request_id": (header.group(1), None)}, None
            current["e2e_total_ms"] = (e2e.get(header.group(1)), None)
            tables.append(current)
        elif header := E2E_HEADER.search(line):
            current, current_e2e = None, header.group(1)
        elif current is not None or current_e2e is not None:
            if row := ROW.search(line):
                if current is not None and row.group(1) != "Field":
                    current[row.group(1)] = (_number(row.group(2)), _number(row.group(3)))
            elif current_e2e is not None and (pair := PAIR.search(line)) and pair.group(1) == "e2e_total_ms":
                e2e[current_e2e] = _number(pair.group(2))
            elif not line.rstrip().endswith(("+", "|")):
                current, current_e2e = None, None
    return tables


def _read_logs(paths: list[Path]) -> dict[str, str]:
    """{file name: text} of the server logs given, unpacking ``.tar.xz`` archives."""
    logs = {}
    for path in paths:
        if path.name.endswith((".tar.xz", ".tgz", ".tar.gz")):
            with tarfile.open(path) as tar:
                for member in tar.getmembers():
                    if member.isfile() and Path(member.name).name.startswith("server_"):
                        logs[Path(member.name).name] = tar.extractfile(member).read().decode(errors="replace")
        else:
            logs[path.name] = path.read_text(errors="replace")
    return logs


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[int(q * 10) - 1] if len(values) > 1 else values[0]


def summarize(run: dict, logs: dict[str, str]) -> list[dict]:
    """One row per (talker, profile, concurrency) of the run's ok HTTP rows whose server log is given."""
    out = []
    for (talker, profile), rows in _by_server(run["rows"]).items():
        name = f"server_{talker}_{profile}.log"
        if name not in logs:
            continue
        tables = stage_tables(logs[name])
        if not tables:
            raise ValueError(f"{name}: no StageRequestStats table (vllm-omni logs one per finished request)")
        longest = max(t["num_tokens_out"][0] or 0 for t in tables)
        timed = [t for t in tables if t["num_tokens_out"][0] == longest]
        wanted = sum(r["requests"] for r in rows)
        if len(timed) < wanted:  # more: a level that was cut before its row was written
            got = f"{len(timed)} requests of {longest:g} Stage-0 rows"
            raise ValueError(f"{name}: {got}, the run's rows count {wanted}")
        for row in rows:
            level, timed = timed[: row["requests"]], timed[row["requests"] :]
            summary = {"talker": talker, "profile": profile, "concurrency": row["concurrency"], "requests": len(level),
                       "stage0_rows": int(longest), "audio_s_per_s": row["audio_s_per_s"]}  # fmt: skip
            for column, stage, field, scale in COLUMNS:
                values = [t[field][stage] * scale for t in level if t.get(field, (None, None))[stage] is not None]
                summary[column + "_p50"] = statistics.median(values) if values else None
                summary[column + "_p90"] = _quantile(values, 0.9) if values else None
            audio = [t["audio_duration_s"][1] for t in level if t.get("audio_duration_s", (None, None))[1] is not None]
            # Stage 1's audio beyond the shortest of the level's (same rows each): a request whose audio went out twice
            summary["s1_over_length"] = sum(a > min(audio) + 0.04 for a in audio) if audio else None
            out.append(summary)
    return out


def _by_server(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The run's ok HTTP rows by server (talker, profile), in the order the levels ran."""
    servers: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if row.get("path") == "http" and row.get("status") == "ok":
            servers.setdefault((row["talker"], row["profile"]), []).append(row)
    return servers


def markdown(summary: list[dict]) -> str:
    head = ["talker", "concurrency", "requests", "audio_s_per_s", *(c + "_p50" for c, *_ in COLUMNS), "s0_step_ms_p90",
            "s1_over_length"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary:
        cells = [row[h] for h in head]
        lines.append("| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="bench_omni.py's JSON")
    p.add_argument("logs", type=Path, nargs="+", help="the run's server_<talker>_<profile>.log files or a .tar.xz")
    p.add_argument("--out", type=Path, default=None, help="write <run>_stages.json here")
    args = p.parse_args()
    try:
        summary = summarize(json.loads(args.run.read_text()), _read_logs(args.logs))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not summary:
        raise SystemExit(f"no server log given matches an ok HTTP row of {args.run}")
    print(markdown(summary))
    if args.out:
        path = args.out / f"{args.run.stem}_stages.json"
        path.write_text(json.dumps({"run": args.run.name, "from": "vllm-omni's StageRequestStats", "rows": summary},
                                   indent=1))  # fmt: skip
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

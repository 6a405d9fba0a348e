"""Cold start: process start -> model loaded -> first decode step, with empty and with warm caches.

Every case is a fresh ``python -c`` process whose FlashInfer (tvm-ffi, Triton) caches and choice cache (what
warm-up measured: GEMV tiles, decode kernels, graph paths; ``cuda_graphs.choice_cache``) are pointed at a chosen
directory (``higgs_talker.kernel_cache.cache_env``), on a 4B-shaped checkpoint with random bf16 weights
(``bench_vllm.write_random_checkpoint``; ``--tiny`` or ``--model DIR`` instead):

- ``cold``: a new, empty cache directory, so FlashInfer JIT-compiles every kernel (minutes on a fresh H200) and
  warm-up measures every choice (``choices``: measured);
- ``warm``: the same directory again, after ``cold``: compiled kernels and cached choices (``choices``: cached,
  checked but not timed); with ``--no-cold``, the caches ``--cache-dir`` names (default: this machine's usual
  ones, as they are; ``cache_dir_state`` and ``caches_before`` say what each held: FlashInfer and tvm-ffi modules,
  Triton cubins, choice entries). A fresh machine given only FlashInfer's cache is not warm: it compiles every
  Triton kernel (the one-row GEMV tiles warm-up tries, the frame kernels), minutes at the 4B shape;
- ``warm_measured`` (``--measured-too``): the same kernel caches with the choice cache off, so warm-up times
  every choice again (the start before the choice cache);
- ``warmup_cmd`` and ``after_warmup`` (``--with-warmup``): ``higgs-talker warmup`` into another new directory,
  timed as a whole, then one run on that directory.

A child logs warm-up's phases (INFO, stamped from its spawn) on stderr, whose tail a failed or timed-out case keeps
in ``stderr_tail``; give ``--timeout`` below any limit around the whole script, so a slow case still writes its row.
A child stamps the wall clock at each point against the stamp its parent took just before spawning it:
``import_s`` (interpreter, torch, higgs_talker), ``load_s`` (``from_pretrained``: FlashInfer's import, weights,
decode-kernel choice and graph capture, and the JIT they trigger; ``graph_warmup_s`` is the part inside the graph
runner), ``first_step_s`` (the prefill step and the first decode step), ``total_s`` (spawn -> end of that step);
``choices`` says whether warm-up measured its choices or read them from the choice cache; ``phases`` lists each
INFO record of the load ([seconds from spawn, logger, message]: the weights loaded, the graph policy, each kernel
choice, the warm-up's end), which splits ``load_s`` into its parts; ``heavy_imports``: which of torch._dynamo,
transformers, transformers' model registry (``models.auto.modeling_auto``) and sympy the child had imported by then
(each costs seconds where no bytecode is cached); ``bytecode``: the directory the child read bytecode from, as the
``higgs-talker`` command does (``higgs_talker.bytecode.use_bytecode``: only on an image that ships none, once
``higgs-talker warmup`` wrote it; the ``after_warmup`` case of ``--with-warmup``), else None.

    python benchmarks/bench_coldstart.py --out $OUT                    # cold, then warm
    python benchmarks/bench_coldstart.py --measured-too --out $OUT     # plus warm kernels, choices measured
    python benchmarks/bench_coldstart.py --no-cold --out $OUT          # warm only (the usual cache)
    python benchmarks/bench_coldstart.py --with-warmup --out $OUT      # plus higgs-talker warmup, then a run
    python benchmarks/bench_coldstart.py --device cpu --tiny           # smoke mode (nothing compiles on CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from common import REPO_ROOT, ResultFile, environment, log, print_table, resolve_device

from higgs_talker.kernel_cache import (
    CHOICE_CACHE_VAR,
    cache_dirs,
    cache_env,
    count_all,
    count_modules,
)

CHILD = r"""
import json, logging, sys, time
spawned, opts = float(sys.argv[1]), json.loads(sys.argv[2])
# warm-up's phases, stamped from spawn, on stderr: a case cut by --timeout keeps their tail in its row
logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                    format=f"%(relativeCreated)9.0f ms +{time.time() - spawned:.2f} s %(name)s: %(message)s")
phases = []  # [s from spawn, logger, message's first line] of each INFO record: where load_s went


class Phases(logging.Handler):
    def emit(self, record):
        phases.append([round(record.created - spawned, 3), record.name, record.getMessage().split("\n")[0][:400]])


logging.getLogger().addHandler(Phases(logging.INFO))
from higgs_talker.bytecode import use_bytecode
bytecode = use_bytecode()  # as the higgs-talker command does: where the image ships none, what warmup wrote
import torch
from higgs_talker import HiggsTalker, SamplingParams
from higgs_talker.kernel_cache import cache_dirs, count_all, count_modules
imported = time.time()
talker = HiggsTalker.from_pretrained(opts["model"], opts["device"], opts["dtype"], graph_mode=opts["graph_mode"],
                                     codec=False, **opts["engine"])
if talker.engine.device.type == "cuda":
    torch.cuda.synchronize()
loaded = time.time()
engine = talker.engine
rid = engine.add_request(talker.build_prompt(opts["text"]), SamplingParams(seed=0, max_frames=8))
while len(engine.requests[rid].rows) < 2 and engine.has_unfinished():  # the prefill's row, then one decode row
    engine.step()  # ends in the step's one host sync
first = time.time()
graphs = engine.graphs
cache = cache_dirs()["flashinfer"]
entry = graphs.choice_file if graphs is not None else None
print("RESULT:" + json.dumps({
    "import_s": imported - spawned, "load_s": loaded - imported, "first_step_s": first - loaded,
    "total_s": first - spawned, "graph_warmup_s": graphs.warmup_s if graphs is not None else 0.0,
    "rows": len(engine.requests[rid].rows), "kernels": talker.model.kernels.name,
    "flashinfer_cache": str(cache), "modules_after": count_modules(cache), "caches_after": count_all(cache_dirs()),
    "choices": graphs.choices_source if graphs is not None else "none",
    "choice_file": None if entry is None else str(entry), "phases": phases,
    "bytecode": None if bytecode is None else str(bytecode),
    "heavy_imports": [m for m in ("torch._dynamo", "transformers", "transformers.models.auto.modeling_auto", "sympy")
                      if m in sys.modules]}), flush=True)
"""

TEXT = "The first sentence after a cold start."


def child_env(base: Path | None, choices: bool = True) -> dict[str, str]:
    """The environment of a child: caches under ``base`` (None: as inherited); ``choices=False``: no choice cache."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **(cache_env(base) if base is not None else {}), "PYTHONPATH": path}
    return env | ({} if choices else {CHOICE_CACHE_VAR: "off"})


def child_caches(base: Path | None, choices: bool = True) -> dict[str, Path]:
    """The cache directories of a child whose caches are under ``base`` (None: as inherited): ``cache_dirs`` read
    in the child's environment (this process never imports FlashInfer, so its rule applies, as in the child)."""
    with mock.patch.dict(os.environ, child_env(base, choices), clear=True):
        return cache_dirs()


def flashinfer_dir(base: Path | None) -> Path:
    """FlashInfer's cache directory in a child whose caches are under ``base`` (None: the inherited setting)."""
    return child_caches(base)["flashinfer"]


def cache_counts(base: Path | None, choices: bool = True) -> dict[str, int]:
    """What each cache a child with caches under ``base`` uses holds (``kernel_cache.count_all``: FlashInfer and
    tvm-ffi modules, Triton cubins, choice entries); a fresh machine with only FlashInfer's cache carried over
    still compiles every Triton kernel, which this shows."""
    return count_all(child_caches(base, choices))


def found(base: Path | None, choices: bool = True) -> str:
    """``as found (...)``: the state of the caches a warm case starts from."""
    return "as found (" + ", ".join(f"{n} {name}" for name, n in cache_counts(base, choices).items()) + ")"


def write_checkpoint_apart(path: Path) -> Path:
    """``bench_vllm.write_random_checkpoint`` in a process of its own: it draws on the GPU, and a CUDA context
    (with whatever the allocator keeps) in this process would take device memory from every start measured after
    it, memory a real start would have (the KV cache is sized from the free memory)."""
    path = path.absolute()
    code = (
        "import sys; from pathlib import Path; from bench_vllm import write_random_checkpoint as w; "
        "w(Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, cwd=Path(__file__).resolve().parent)
    return path


def run_child(case: str, state: str, base: Path | None, opts: dict, timeout: int, choices: bool = True) -> dict:
    """One fresh process from spawn to its first decode step -> a row."""
    cache = flashinfer_dir(base)
    row = {"case": case, "cache_dir_state": state, "cache_dir": str(cache), "modules_before": count_modules(cache),
           "caches_before": cache_counts(base, choices)}  # fmt: skip
    spawned = time.time()
    try:
        argv = [sys.executable, "-c", CHILD, repr(spawned), json.dumps(opts)]
        proc = subprocess.run(argv, env=child_env(base, choices), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return row | {"status": "timeout", "total_s": time.time() - spawned, "stderr_tail": _tail(exc.stderr)}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT:")]
    if proc.returncode or not lines:
        return row | {"status": "error", "returncode": proc.returncode, "stderr_tail": _tail(proc.stderr)}
    result = json.loads(lines[-1][len("RESULT:") :])
    row |= {"status": "ok", **result, "new_modules": result["modules_after"] - row["modules_before"]}
    if result["flashinfer_cache"] != str(cache):  # FlashInfer chose another place than the one this case set
        row["status"] = "cache_dir_mismatch"
    return row


def run_warmup(base: Path, args: argparse.Namespace, timeout: int) -> dict:
    """``higgs-talker warmup`` into ``base`` in a fresh process, timed as a whole by this one."""
    cmd = [sys.executable, "-m", "higgs_talker.cli", "warmup", args.model, "--device", args.device,
           "--cache-dir", str(base)]  # fmt: skip
    optional = {"--dtype": args.dtype, "--graph-mode": args.graph_mode, "--max-model-len": args.max_model_len}
    cmd += [str(x) for flag, value in optional.items() if value is not None for x in (flag, value)]
    row = {"case": "warmup_cmd", "cache_dir_state": "empty", "cache_dir": str(flashinfer_dir(base))}
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, env=child_env(None), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return row | {"status": "timeout", "total_s": time.time() - t0, "stderr_tail": _tail(exc.stderr)}
    wall, after = time.time() - t0, count_modules(flashinfer_dir(base))
    row |= {"status": "ok" if proc.returncode == 0 else "error", "total_s": wall, "new_modules": after,
            "output": proc.stdout.strip()}  # fmt: skip
    return row if proc.returncode == 0 else row | {"returncode": proc.returncode, "stderr_tail": _tail(proc.stderr)}


def _tail(text: str | bytes | None, n: int = 3000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def main(argv: list[str] | None = None) -> ResultFile:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint (the default on CPU)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: a random 4B-shaped one)")
    p.add_argument("--ckpt-dir", default="/tmp/higgs_4b_random", help="where the random checkpoint is written")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the engine's)")
    p.add_argument("--graph-mode", default=None, help="eager, local_mlp, full_decode or auto (default: the engine's)")
    p.add_argument("--max-model-len", type=int, default=None, help="the engine's max_model_len (default: its own)")
    p.add_argument("--no-cold", action="store_true", help="skip the empty-cache case (minutes of GPU time)")
    p.add_argument("--cache-dir", type=Path, default=None, help="with --no-cold: the cache the warm runs use")
    p.add_argument("--with-warmup", action="store_true", help="also: higgs-talker warmup into a new dir, then a run")
    p.add_argument("--measured-too", action="store_true",
                   help="also: a warm run with the choice cache off (warm-up times every choice again)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="warm runs (default 1; 0: none)")
    p.add_argument("--work-dir", type=Path, default=None, help="where new cache dirs go (default: a temp dir, removed)")
    p.add_argument("--timeout", type=int, default=900, help="s per process, JIT included (default 900)")
    p.add_argument("--out", default=None, help="directory of the JSON (default: benchmarks/results)")
    args = p.parse_args(argv)
    if args.repeats < 0:
        p.error(f"--repeats must be >= 0, got {args.repeats}")
    device = resolve_device(args.device)
    if args.tiny or (args.model is None and device.type != "cuda"):
        from higgs_talker.tiny import tiny_checkpoint

        args.model = str(tiny_checkpoint())
    elif args.model is None:
        log(f"random 4B-shaped checkpoint in {args.ckpt_dir}")
        args.model = str(write_checkpoint_apart(Path(args.ckpt_dir)))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="higgs_coldstart_"))
    work.mkdir(parents=True, exist_ok=True)
    engine = {} if args.max_model_len is None else {"max_model_len": args.max_model_len}
    opts = {"model": args.model, "device": args.device, "dtype": args.dtype, "graph_mode": args.graph_mode,
            "text": TEXT, "engine": engine}  # fmt: skip
    meta = environment(device, "bench_coldstart.py", argv) | {"model": args.model, "work_dir": str(work)}
    writer = ResultFile(args.out, "coldstart", meta, smoke=args.tiny)

    def add(row: dict) -> None:
        writer.add(row)
        log(f"{row['case']} ({row['cache_dir_state']}): {row['status']}, {row.get('total_s', float('nan')):.1f} s")

    try:
        if args.no_cold:
            warm_base, state = args.cache_dir, None
        else:
            warm_base, state = work / "cold", "after cold run"
            warm_base.mkdir()
            add(run_child("cold", "empty", warm_base, opts, args.timeout))
        for _ in range(args.repeats):
            add(run_child("warm", state or found(warm_base), warm_base, opts, args.timeout))
        if args.measured_too:
            measured = f"{state or found(warm_base, choices=False)}, choice cache off"
            add(run_child("warm_measured", measured, warm_base, opts, args.timeout, choices=False))
        if args.with_warmup:
            base = work / "warmup"
            add(run_warmup(base, args, args.timeout))
            add(run_child("after_warmup", "after higgs-talker warmup", base, opts, args.timeout))
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    cols = ["case", "cache_dir_state", "import_s", "load_s", "graph_warmup_s", "first_step_s", "total_s",
            "new_modules", "choices", "status"]  # fmt: skip
    print_table(writer.rows, cols, f"cold start: {Path(args.model).name} on {device}")
    return writer


if __name__ == "__main__":
    main()

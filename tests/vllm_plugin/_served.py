"""What the vLLM tests that serve through a script share: run it, read its ``RESULT:`` line, bind one core per
CPU rank or engine, and the one-process direct engine's rows for a request of the same spec."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from serve_tiny import reference_codes

from higgs_talker import HiggsTalker, Reference, SamplingParams


def run_served(cmd: list[str], env: dict[str, str], timeout: float = 570, log: Path | None = None) -> dict:
    """Run a serve script; its ``RESULT:`` JSON line (the output tails in the failure when there is none).
    ``log``: its stdout, then its stderr, end up there (its directory is created). While it runs they go to
    files (``log`` and a ``.stderr`` beside it), so a run cut short still leaves what it printed. A run past
    ``timeout`` fails the test with the tail of its stderr (a cold FlashInfer JIT takes minutes)."""
    with tempfile.TemporaryDirectory(prefix="served_") as scratch:
        log = log or Path(scratch, "run.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        err_log = log.with_name(log.stem + ".stderr" + log.suffix)
        with open(log, "w") as stdout, open(err_log, "w") as stderr:
            try:
                proc = subprocess.run(cmd, stdout=stdout, stderr=stderr, timeout=timeout, env=env)
            except subprocess.TimeoutExpired as exc:
                tail = err_log.read_text(errors="replace")[-4000:]
                pytest.fail(f"{Path(cmd[1]).name} did not finish in {exc.timeout} s; stderr tail ({err_log}):\n{tail}")
        out, err = log.read_text(errors="replace"), err_log.read_text(errors="replace")
        log.write_text(out + "\n--- stderr ---\n" + err)  # one file, as the callers read it back
        err_log.unlink()
    lines = [x for x in out.splitlines() if x.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, (out[-3000:], err[-6000:])
    return json.loads(lines[0][len("RESULT:") :])


def one_core_each(n: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``n`` CPU ranks or engines, one of this process's cores each (vLLM cannot
    choose them itself on a single NUMA node); skips the test where fewer cores are allowed."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        pytest.skip(f"{n} CPU workers need {n} cores")
    return "|".join(str(c) for c in cores[:n])


def spec_params(spec: dict, talker: HiggsTalker) -> SamplingParams:
    """The direct engine's sampling for a serve-script spec request: its sampling fields, and vLLM's max_tokens
    (delayed rows, one per decode step) as audio frames, C fewer."""
    return SamplingParams(temperature=spec.get("temperature", 0.0), top_k=spec.get("top_k", -1),
                          top_p=spec.get("top_p", 1.0), seed=spec.get("seed"),
                          max_frames=spec["max_tokens"] - talker.cfg.num_codebooks)  # fmt: skip


def spec_reference(spec: dict, cfg) -> Reference | None:
    """The voice-clone reference of a spec request on a checkpoint of config ``cfg``: the codes serve_tiny drew
    for it, and its text."""
    codes = reference_codes(spec, cfg)
    return None if codes is None else Reference(codes=codes, text=spec["reference"]["text"])


def direct_rows(ckpt: Path, spec: dict) -> torch.Tensor:
    """The rows the direct engine (CPU, one process) gives the request ``spec`` (a serve-script spec entry)."""
    talker = HiggsTalker.from_pretrained(ckpt, codec=False)
    return talker.generate(spec["text"], spec_params(spec, talker)).rows.long()

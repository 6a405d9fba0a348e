"""What the vLLM tests that serve through a script share: run it, read its ``RESULT:`` line, bind one core per
CPU rank or engine, and the one-process direct engine's rows for a request of the same spec."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from serve_tiny import reference_codes

from higgs_talker import HiggsTalker, Reference, SamplingParams


def run_served(cmd: list[str], env: dict[str, str], timeout: float = 570, log: Path | None = None) -> dict:
    """Run a serve script; its ``RESULT:`` JSON line (the output tails in the failure when there is none).
    ``log``: keep the script's stdout and stderr there (its directory is created). A run past ``timeout`` fails
    the test with the tail of what it printed (a cold FlashInfer JIT takes minutes)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-4000:]
        pytest.fail(f"{Path(cmd[1]).name} did not finish in {exc.timeout} s; stderr tail:\n{tail!r}")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out.stdout + "\n--- stderr ---\n" + out.stderr)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT:")]
    assert out.returncode == 0 and lines, (out.stdout[-3000:], out.stderr[-6000:])
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

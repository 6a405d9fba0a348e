"""What our talker's sampler ranked inside vLLM / vllm-omni, kept for the score checks of the plugin's suites
(``_reference_check.ScoreCheck.check_scores``: a run's own scores against the float32 reference, row by row).

``record_scores(adapter)`` wraps one adapter (``HiggsTalkerForConditionalGeneration``) in the process it lives in:
at every row a request publishes it keeps the masked logits / T (/ 1 for greedy), [C, V] float32, as
``teacher_forced`` gives them for the reference (its ``scaled``), and the row itself. Rows a step samples but does
not publish (a partial prefill's, the forced EOS step's after a request's last row) are dropped.

``install(directory)`` does it for every adapter a process builds, for processes this test cannot reach into
(vllm-omni's Stage-0 worker, vLLM's engine core): an import hook wraps the adapter class's ``__init__`` when
``higgs_talker.vllm_plugin.talker`` is imported. Each request's record goes to ``directory/<pid>_<request id>.pt``
(``{"req_id", "rows" [T, C] int64, "scaled" [T, C, V] float32, "frame_replays"}``: the last, the steps the
adapter's frame graphs had replayed by then) when the runner says it finished or left the
batch, and again at the process's exit (atexit and multiprocessing's finalizers). This folder's
``sitecustomize.py`` calls it in every Python process started with the folder on ``PYTHONPATH`` and
``HIGGS_SCORE_PROBE_DIR`` set. ``load(directory)`` reads the files back: ``{request id: record}``.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing.util
import os
import re
import sys
from pathlib import Path

TARGET_MODULE, TARGET_CLASS = "higgs_talker.vllm_plugin.talker", "HiggsTalkerForConditionalGeneration"
FOLDER = Path(__file__).resolve().parent
_PROBES = str(FOLDER.parents[2] / "benchmarks" / "probes")
if _PROBES not in sys.path:
    sys.path.append(_PROBES)  # after_import, which the probes share
import after_import  # noqa: E402


def probe_env(directory: str | os.PathLike) -> dict[str, str]:
    """The variables that load the probe into every Python process a command starts (this folder first on
    ``PYTHONPATH``), recording to ``directory``."""
    path = os.pathsep.join(x for x in (str(FOLDER), os.environ.get("PYTHONPATH")) if x)
    return {"HIGGS_SCORE_PROBE_DIR": str(directory), "PYTHONPATH": path}


def record_scores(adapter) -> dict[str, dict[int, tuple]]:
    """Wrap ``adapter``'s sampling; returns ``{request id: {row index: (scaled [C, V], row [C])}}``, filled as the
    steps' rows reach the host records (``RequestSlots.settle``: a step is recorded a step later than sampled)."""
    from collections import deque

    import torch

    import higgs_talker.heads.slots as slots_module
    from higgs_talker.cuda_graphs.frame import FrameGraphs
    from higgs_talker.cuda_graphs.policy import stream_is_capturing

    recorded: dict[str, dict[int, tuple]] = {}
    ranked: list = []  # the step being sampled: (row index, scaled [C, V]) per request
    sampled: deque = deque()  # per step on its way to the host records, oldest first: its rankings (or None)
    slots = adapter.slots
    real_codes, real_later, real_record = slots_module.sample_codes, slots.record_later, slots.record

    def ranking(logits, temperature, top_k, top_p, seeds, steps, **shortcuts):
        if stream_is_capturing():  # a frame graph's capture: replays are ranked in ``frame_run``
            return real_codes(logits, temperature, top_k, top_p, seeds, steps, **shortcuts)
        t = torch.where(temperature > 0, temperature.float(), torch.ones_like(temperature.float()))
        scaled = (logits.float() / t[:, None, None]).cpu()
        ranked[:] = [(int(steps[i]), scaled[i]) for i in range(scaled.shape[0])]
        return real_codes(logits, temperature, top_k, top_p, seeds, steps, **shortcuts)

    def record_later(req_ids, results):
        sampled.append(list(ranked) if len(ranked) == len(req_ids) else None)
        ranked.clear()
        return real_later(req_ids, results)  # settles the step before (``record`` pops its rankings)

    def record(req_ids, host):
        published = real_record(req_ids, host)
        ranks = sampled.popleft() if sampled else None
        if ranks is not None:
            for key, row, (t, scaled) in zip(req_ids, published, ranks, strict=True):
                if key is not None and row is not None:
                    recorded.setdefault(key, {})[t] = (scaled, row.reshape(-1).long().cpu())
        return published

    def frame_run(graphs, step_slots, hidden, *args):
        """A frame graph's step (cuda_graphs.frame) runs no Python: the eager frame ranks the same step first (its
        state put back after), then the graph replays it (or the adapter runs it eagerly, ranking it again)."""
        if graphs.slots is slots and not stream_is_capturing():
            seed_pos = slots.seed_pos.clone()
            with slots.store.preserved(step_slots.tolist()):
                graphs.frame(slots, graphs.head, step_slots, hidden, *args)
            slots.seed_pos.copy_(seed_pos)
        return real_run(graphs, step_slots, hidden, *args)

    real_run = FrameGraphs.run
    FrameGraphs.run = functools.wraps(real_run)(frame_run)
    slots_module.sample_codes, slots.record_later, slots.record = ranking, record_later, record
    return recorded


def as_record(req_id: str, steps: dict[int, tuple]) -> dict:
    """One request's recorded steps as tensors (its rows must run 0..T-1 without a gap)."""
    import torch

    order = sorted(steps)
    if order != list(range(len(order))):
        raise ValueError(f"request {req_id}: recorded rows {order[:5]}... do not run from 0 without a gap")
    return {"req_id": req_id, "rows": torch.stack([steps[t][1] for t in order]),
            "scaled": torch.stack([steps[t][0] for t in order])}  # fmt: skip


class Recording:
    """``record_scores`` on one adapter, its requests written to ``directory`` as they leave and at exit."""

    def __init__(self, adapter, directory: str | os.PathLike) -> None:
        self.directory, self.pid = Path(directory), os.getpid()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.recorded, self.slots, self.adapter = record_scores(adapter), adapter.slots, adapter
        for name in ("on_requests_finished", "on_requests_removed"):
            real = getattr(adapter, name)
            setattr(adapter, name, functools.partial(self._leaving, real))
        multiprocessing.util.Finalize(self, self.write, exitpriority=100)  # a multiprocessing child's exit
        atexit.register(self.write)

    def _leaving(self, real, req_ids, *args, **kwargs):
        self.slots.settle()  # the leaving requests' last sampled rows (the adapter drops them unrecorded)
        out = real(req_ids, *args, **kwargs)
        self.write([r for r in req_ids if r in self.recorded])
        return out

    def write(self, req_ids=None) -> None:
        """Write the requests' records (all by default), each file replaced whole."""
        import torch

        if os.getpid() != self.pid:  # a forked child inherits the object, not the adapter
            return
        for req_id in list(self.recorded) if req_ids is None else req_ids:
            path = self.directory / f"{self.pid}_{re.sub(r'[^A-Za-z0-9_.-]', '_', req_id)}.pt"
            tmp = path.with_suffix(".tmp")
            graphs = getattr(self.adapter, "frame_graphs", None)  # steps its frame graphs replayed so far
            torch.save(as_record(req_id, self.recorded[req_id]) | {"frame_replays": graphs.replays if graphs else 0},
                       tmp)  # fmt: skip
            os.replace(tmp, path)


def load(directory: str | os.PathLike) -> dict[str, dict]:
    """The records under ``directory`` by request id (a request written by two processes: ValueError)."""
    import torch

    out: dict[str, dict] = {}
    for path in sorted(Path(directory).glob("*.pt")):
        record = torch.load(path)
        if record["req_id"] in out:
            raise ValueError(f"request {record['req_id']} was recorded by two processes ({path.name})")
        out[record["req_id"]] = record
    return out


def install(directory: str) -> None:
    """Record every adapter this process builds (once per process)."""
    after_import.install("score_probe", {TARGET_MODULE: functools.partial(_record_every_adapter, directory=directory)})


def _record_every_adapter(module, directory: str) -> None:
    """Wrap the adapter class's ``__init__``: each adapter records to ``directory``."""
    cls = getattr(module, TARGET_CLASS)
    init = cls.__init__

    @functools.wraps(init)  # vLLM reads the signature (``vllm_config``) through ``__wrapped__``
    def __init__(adapter, *args, **kwargs):
        init(adapter, *args, **kwargs)
        adapter._score_recording = Recording(adapter, directory)

    cls.__init__ = __init__

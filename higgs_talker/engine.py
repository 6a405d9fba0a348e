"""The engine: glue between the host scheduler, the device model runner and (on CUDA) the graph runner.

``step()`` is schedule -> run -> publish: the scheduler turns its queue into one ``StepBatch`` (a prefill of
admitted requests, else a decode of every running one), the graph runner replays it when a captured bucket
holds it (else the model runner executes it eagerly), and the scheduler publishes one owned ``[1, C]`` int32
row per request. A step that raises fails exactly the requests it was running (``Request.error``) and leaves
every other request as it was.

With asynchronous scheduling (``EngineConfig.async_scheduling``, on by default on CUDA) a step is published
while the next one already runs: ``step()`` queues step t + 1 on the device (``Scheduler.schedule_ahead``: the
prefill of requests that can be admitted, else the next decode), then waits for step t's rows and publishes
them. Each call still returns the rows of the step it waited for, and the codes are the same; the device no
longer idles while the host publishes and plans. A request that ends at step t (EOC, cancel) has had step t + 1
computed for nothing.

The public methods take one lock, so an engine may be shared by threads; ``HiggsTalker`` drives it from one
worker thread that batches every caller's requests. ``step()`` lets go of it while it waits for the device, so
callers add and cancel requests without waiting for a step to finish (one ``step()`` runs at a time).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from .attention import AttentionBackend
from .config import SpecialTokens, TalkerConfig
from .heads.sampling import SamplingParams
from .heads.slots import HostCopy
from .kv_cache import budget_num_blocks, free_memory_bytes
from .model import TalkerModel
from .model_runner import ModelRunner
from .prompt import Prompt
from .scheduler import EngineConfig, Request, Scheduler, Status, StepOutput

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "Request", "Status", "StepOutput"]


class Engine:
    def __init__(
        self,
        model: TalkerModel,
        cfg: TalkerConfig,
        specials: SpecialTokens,
        config: EngineConfig | None = None,
        attention: AttentionBackend | None = None,
        decode_kernel: str = "auto",
    ) -> None:
        self.cfg, self.specials = cfg, specials
        self.config = ec = config or EngineConfig()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_model_len = ec.model_len(cfg)
        per_seq = -(-self.max_model_len // ec.block_size)
        num_blocks = ec.num_blocks or self._budget_blocks(ec.max_num_seqs * per_seq, per_seq)
        self.runner = ModelRunner(
            model,
            cfg,
            specials,
            max_num_seqs=ec.max_num_seqs,
            num_blocks=num_blocks,
            block_size=ec.block_size,
            max_model_len=self.max_model_len,
            attention=attention,
            decode_kernel=decode_kernel,
        )
        self.scheduler = Scheduler(ec, cfg, num_blocks=num_blocks, max_model_len=self.max_model_len)
        self.graphs = None  # a cuda_graphs.GraphRunner after warm_up()
        self.async_scheduling = self.device.type == "cuda" if ec.async_scheduling is None else ec.async_scheduling
        self._ahead: HostCopy | None = None  # a decode step on the device whose rows are not published yet
        self.num_steps = 0
        self._lock = threading.RLock()  # the scheduler's state
        self._stepping = threading.Lock()  # one step() at a time (it lets go of _lock while the device works)

    def _budget_blocks(self, want: int, per_seq: int) -> int:
        """Enough blocks for max_num_seqs full-length sequences, at most what ``kv_memory_fraction`` of the free
        device (or host) memory holds; one full-length sequence must fit."""
        ec = self.config
        blocks = budget_num_blocks(self.cfg.text, self.dtype, self.device, ec.block_size, want, ec.kv_memory_fraction)
        if blocks < per_seq:
            raise ValueError(
                f"the KV cache for one {self.max_model_len}-token sequence ({per_seq} blocks) does not fit in "
                f"{ec.kv_memory_fraction:.0%} of the free {self.device.type} memory ({blocks} blocks); lower "
                "max_model_len or set num_blocks"
            )
        if blocks < want:
            free = free_memory_bytes(self.device)
            logger.info("KV cache: %d blocks fit (%.0f%% of %s free), fewer than the %d for %d full-length "
                        "sequences", blocks, 100 * ec.kv_memory_fraction,
                        "unknown memory" if free is None else f"{free / 2**30:.1f} GiB", want,
                        ec.max_num_seqs)  # fmt: skip
        return blocks

    @property
    def requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    def warm_up(
        self,
        graph_mode,
        buckets: Sequence[int] | None = None,
        prefill_buckets: Sequence[int] | None = None,
        choice_cache: str | Path | bool | None = None,
    ) -> None:
        """CUDA only: measure the decode kernels and capture the graphs ``graph_mode`` needs (before serving).
        ``buckets``: decode batch buckets; ``prefill_buckets``: prefill token buckets (default ``PREFILL_BUCKETS``,
        replayed as graphs in the modes that graph whole steps; ``()``: every prefill runs unpadded).
        ``choice_cache``: where measured choices are kept between starts (``cuda_graphs.choice_cache
        .open_choice_cache``: a directory, None for the default, False for none)."""
        from .cuda_graphs import DEFAULT_BUCKETS, PREFILL_BUCKETS, GraphRunner
        from .cuda_graphs.choice_cache import open_choice_cache

        with self._lock:
            runner = GraphRunner(
                self.runner, graph_mode, buckets or DEFAULT_BUCKETS, self.config.max_num_seqs,
                PREFILL_BUCKETS if prefill_buckets is None else prefill_buckets, open_choice_cache(choice_cache),
            )  # fmt: skip
            runner.warm_up()
            self.graphs = runner

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt; returns its request id. Raises ``ValueError``/``TypeError`` for a bad request."""
        with self._lock:
            return self.scheduler.add(prompt, params, request_id)

    def cancel(self, request_id: str) -> bool:
        """Stop a request now, freeing its KV blocks and slot. Returns False if it was not live."""
        with self._lock:
            cancelled = self.scheduler.cancel(request_id)
            if cancelled and self._ahead is not None and self.scheduler.discard_finished():
                self._ahead = None  # it was the last live request of the step ahead
            return cancelled

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished()

    def pop_finished(self, request_id: str) -> Request:
        """Forget a finished request and return it (its rows, timings and, if it failed, ``error``)."""
        with self._lock:
            return self.scheduler.pop_finished(request_id)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[StepOutput]:
        """Run one prefill or decode step; returns one output per request that took part (or finished).

        With asynchronous scheduling the next step is queued first (module docstring). If the step
        raises, the requests it was running end with ``finish_reason="error"`` and the exception in
        ``Request.error``, and the exception propagates; all other requests are untouched.
        """
        with self._stepping, torch.inference_mode():
            outputs: list[StepOutput] = []
            with self._lock:
                current, self._ahead = self._ahead, None
                if current is None:
                    batch = self.scheduler.schedule(outputs)
                    if batch is None:
                        self.num_steps += 1
                        return outputs
                    try:
                        current = self._launch(batch)
                    except BaseException as exc:
                        self.scheduler.abort(exc)
                        raise
                failed = None
                if self.async_scheduling:
                    try:  # the next step goes on the device before this one's rows are read
                        ahead = self.scheduler.schedule_ahead()
                        self._ahead = None if ahead is None else self._launch(ahead)
                    except BaseException as exc:  # noqa: BLE001 - publish the running step first, then fail this one
                        failed = exc
            outputs += self._publish(current)
            with self._lock:
                if failed is not None:
                    self.scheduler.abort(failed)
                    raise failed
                if self._ahead is not None and self.scheduler.discard_finished():
                    self._ahead = None  # every request of the step ahead has ended: its rows are never read
                self.num_steps += 1
                return outputs

    def _launch(self, batch) -> HostCopy:
        graphs = self.graphs
        rows = self.runner.run(batch) if graphs is None else graphs.run(batch)
        return HostCopy(rows)

    def _publish(self, launched: HostCopy) -> list[StepOutput]:
        """Wait (without the lock) for the oldest unpublished step and publish it; if waiting raises (the device
        failed), every unpublished step's requests fail."""
        try:
            rows = launched.wait()
        except BaseException as exc:
            with self._lock:
                self._ahead = None
                self.scheduler.abort_all(exc)
            raise
        with self._lock:
            return self.scheduler.publish(rows)

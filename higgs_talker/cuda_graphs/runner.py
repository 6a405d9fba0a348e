"""The graph runner: wraps a ``ModelRunner`` with the same ``run(batch) -> rows`` contract.

- ``eager``: no graphs, but batches still take the bucket path (padded, fixed attention buffers), so every
  mode launches the same kernels on the same shapes and gives the same codes.
- ``local_mlp``: local MLP graphs for decode; attention eager.
- ``full_decode``: full decode-step graphs; the local path is off (policy).
- ``auto``: both sets of decode graphs, one pool. At warm-up each bucket times a full-graph replay against an
  eager step with local MLP graphs (same padded batch) and keeps the faster; a step then uses exactly one of
  them.

Prefill token buckets (``prefill_buckets``, default ``PREFILL_BUCKETS``) work the same way where the attention
backend has fixed buffers for them (FlashInfer): in every mode a prefill is padded to the smallest bucket that holds
it, and ``full_decode`` and ``auto`` replay the bucket's prefill graph (``prefill.py``); a bucket whose capture
failed, and the other modes, run the padded batch eagerly. A prefill that fits no bucket runs unpadded on the model
runner. Warm-up first measures, on CUDA, whether each linear's inputs of one row, and of 2 to 16 rows, take our
Triton kernels (``kernels.choose_row_linears``), then the attention backend's decode kernels per bucket, inside the
model's whole decode step (``kernels.choose_decode_kernels``). Decode batches above the largest bucket run on the
model runner unpadded.

With a ``choice_cache`` (``choice_cache.py``) warm-up first looks up what an earlier start with the same key
(``choice_key``) chose, and times nothing it finds there. Each cached choice is still checked as a measured one is:
a tile and a decode kernel against their float references (``kernels.check_row_linears``,
``kernels.check_decode_kernels``), a bucket's graph path by its capture (replayed and compared with eager); in
``auto`` only the cached path of each bucket is captured. What fails its check is measured again, with one warning
for each kind of choice, and the entry is rewritten. ``choices_source`` says where the choices came from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .. import pdl
from .buckets import DEFAULT_BUCKETS, PREFILL_BUCKETS, bucket_for, normalize_buckets
from .capture import graph_pool, median_ms
from .choice_cache import ChoiceCache, Choices, environment_key
from .full_decode import FullDecodeGraphs
from .kernels import (
    check_decode_kernels,
    check_row_linears,
    choose_decode_kernels,
    choose_row_linears,
    row_gemv_option,
    row_table,
    row_tile_candidates,
)
from .local_mlp import LocalMLPGraphs
from .policy import GraphMode, decide
from .prefill import PrefillGraphs

if TYPE_CHECKING:
    from ..batch import StepBatch
    from ..model_runner import ModelRunner

logger = logging.getLogger(__name__)


class GraphRunner:
    def __init__(
        self,
        runner: ModelRunner,
        mode: GraphMode | str,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_batch: int | None = None,
        prefill_buckets: Sequence[int] = PREFILL_BUCKETS,
        choice_cache: ChoiceCache | None = None,
    ) -> None:
        self.runner = runner
        self.decision = decide(mode=mode)
        self.mode = self.decision.mode
        self.buckets = normalize_buckets(buckets, max_batch)
        # prefill token buckets: where the backend has fixed buffers for them (captured in the modes that graph
        # whole steps)
        asked = normalize_buckets(prefill_buckets, allow_empty=True, name="prefill_buckets")
        self.prefill_buckets = asked if getattr(runner.attn, "supports_prefill_graphs", False) else ()
        if asked and not self.prefill_buckets:
            logger.info("prefill token buckets off (the attention backend has none): prefills run unpadded")
        self.local: LocalMLPGraphs | None = None
        self.full: FullDecodeGraphs | None = None
        self._pool: torch.cuda.MemPool | None = None  # the graphs' memory pool (warm_up), alive with them
        self.prefill: PrefillGraphs | None = None
        self.choice: dict[int, str] = {}  # bucket -> "full_decode" | "local_mlp" (auto)
        self.kernel_timings: list[dict] = []
        self.row_timings: list[dict] = []  # the one- and few-row kernels' measurement (kernels.choose_row_linears)
        self.timings: list[dict] = []
        self.warmup_s = 0.0
        self.choice_cache = choice_cache
        # what warm-up chose (row_linears, few_row_linears, bucket_kernels, auto_choice), as cached
        self.choices: Choices = {}
        # per kind of choice: "measured", "cached" or "remeasured" (cached, failed its check, measured again)
        self.choice_sources: dict[str, str] = {}
        self.choices_source = "none"  # over all kinds: "none" (nothing to choose), "measured", "cached", "remeasured"
        self.choice_file: Path | None = None  # the cache entry read or written

    def warm_up(self) -> None:
        """Choose the kernels (measured, or cached and checked) and capture every graph the mode needs, before the
        first request. Each phase logs its time and the device's free memory when it ends (a start that takes
        minutes says where)."""
        runner = self.runner
        logger.info("graph policy: %s", self.decision.reason)
        start = time.perf_counter()
        key = self.choice_key() if self.choice_cache is not None else None
        cached = self.choice_cache.load(key) if key is not None else None
        # before anything is timed or captured: every step uses the choice
        with self._phase("one- and few-row linear tiles"):
            self._choose_row_linears(cached)
        with self._phase("decode kernels"), runner.slots.preserved([runner.slots.scratch]):
            self._choose_decode_kernels(cached, self._kernel_step if runner.device.type == "cuda" else None)
        if self.decision.full_decode or self.decision.local_mlp:
            self._pool = graph_pool()  # one pool for every graph here, alive as long as the runner
            pool = self._pool.id
            if self.prefill_buckets and self.decision.full_prefill:
                self.prefill = PrefillGraphs(runner, self.prefill_buckets, pool)
                with self._phase("prefill graphs"):
                    self.prefill.capture()
            paths = (cached or {}).get("auto_choice", {}) if self.mode is GraphMode.AUTO else {}
            if self.decision.full_decode:  # auto with a cached path: only that path of each bucket
                self.full = FullDecodeGraphs(runner, self.buckets, pool)
                with self._phase("full-decode graphs"):
                    self.full.capture([b for b in self.buckets if paths.get(b) != "local_mlp"])
            if self.decision.local_mlp:
                layers = runner.model.model.layers
                self.local = LocalMLPGraphs(runner.eager_post_attention, len(layers), self.buckets, pool)
                sizes = [b for b in self.buckets if paths.get(b) != "full_decode"]
                with self._phase("local MLP graphs"):
                    self.local.capture(runner.cfg.hidden_size, runner.dtype, runner.device, sizes)
            if self.mode is GraphMode.AUTO:
                with self._phase("graph path per bucket"):
                    self._choose(cached)
        self._keep_choices(key, cached)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        self.warmup_s = time.perf_counter() - start
        logger.info("CUDA graph warm-up (%s, buckets %s, prefill token buckets %s, choices %s) took %.1f s",
                    self.mode.value, list(self.buckets), list(self.prefill_buckets), self.choices_source,
                    self.warmup_s)  # fmt: skip

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Log ``name``'s time (after the device's queue drained) and, on CUDA, the device's free memory."""
        start, device = time.perf_counter(), self.runner.device
        yield
        free = ""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            free = f", {torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB free"
        logger.info("warm-up: %s in %.2f s%s", name, time.perf_counter() - start, free)

    def choice_key(self) -> dict:
        """Everything the measured choices depend on: GPU and versions, model shape, dtype, engine sizes, buckets
        and options (the choice cache's key)."""
        runner, t = self.runner, self.runner.cfg.text
        kernels, attn = runner.model.kernels, runner.attn
        return environment_key(runner.device) | {
            "model": {"hidden": t.hidden_size, "layers": t.num_hidden_layers, "heads": t.num_attention_heads,
                      "kv_heads": t.num_key_value_heads, "head_dim": t.head_dim, "intermediate": t.intermediate_size,
                      "vocab": t.vocab_size, "attention_bias": t.attention_bias,
                      "codebooks": runner.cfg.num_codebooks, "codebook_size": runner.cfg.codebook_size},
            "dtype": str(runner.dtype).removeprefix("torch."),
            "engine": {"max_num_seqs": runner.max_num_seqs, "block_size": runner.block_size,
                       "max_model_len": runner.max_model_len},
            "buckets": list(self.buckets),
            "options": {"graph_mode": self.mode.value, "kernels": kernels.name,
                        "row_gemv": getattr(kernels, "row_gemv", "off"),
                        "row_tiles": row_tile_candidates(kernels, runner.model.model.layers),
                        "fuse_qk_rope": bool(kernels.fuse_qk_rope),
                        "attention": type(attn).__name__, "decode_kernel": getattr(attn, "decode_kernel", None),
                        "decode_kernels": list(attn.decode_kernels), "attend_qkv": getattr(attn, "takes_qkv", False),
                        "pdl": pdl.ENABLED},
        }  # fmt: skip

    def _choose_row_linears(self, cached: Choices | None) -> None:
        """Each linear's tile of the one-row kernel and of the few-row kernel: the cached tiles that pass their
        check, the rest measured."""
        kernels, layers = self.runner.model.kernels, list(self.runner.model.model.layers)
        if row_gemv_option(kernels, layers) == "off":
            return
        self.row_timings = []
        for stage, few in (("row_linears", False), ("few_row_linears", True)):
            tiles = None if cached is None else cached.get(stage)
            if tiles is None:
                self.row_timings += choose_row_linears(kernels, layers, few=few)
                self.choice_sources[stage] = "measured"
            else:
                rows, failed = check_row_linears(kernels, layers, tiles, few=few)
                if failed:
                    logger.warning("choice cache: the cached %s tiles of %s failed their check; measuring them "
                                   "again", stage, ", ".join(failed))  # fmt: skip
                    rows = [r for r in rows if r["linear"] not in failed]
                    rows += choose_row_linears(kernels, layers, failed, few=few)
                self.row_timings += rows
                self.choice_sources[stage] = "remeasured" if failed else "cached"
            self.choices[stage] = {name: tuple(c) for name, c in row_table(kernels, few).items()}

    def _choose_decode_kernels(self, cached: Choices | None, step) -> None:
        """The decode kernel of each bucket: the cached kernels that pass their check, the rest measured (inside
        the whole decode step where ``step`` is given)."""
        attn, buckets = self.runner.attn, list(self.buckets)
        if len(attn.decode_kernels) == 1:  # nothing to choose: every bucket gets the one kernel
            self.kernel_timings = choose_decode_kernels(attn, buckets, step=step)
            return
        kernels = None if cached is None else cached.get("bucket_kernels")
        if kernels is None:
            self.kernel_timings = choose_decode_kernels(attn, buckets, step=step)
            self.choice_sources["bucket_kernels"] = "measured"
        else:
            rows, failed = check_decode_kernels(attn, {b: kernels.get(b) for b in buckets})
            if failed:
                logger.warning("choice cache: the cached decode kernels of buckets %s failed their check; measuring "
                               "them again", failed)  # fmt: skip
                rows = [r for r in rows if r["bucket"] not in failed] + choose_decode_kernels(attn, failed, step=step)
            self.kernel_timings = rows
            self.choice_sources["bucket_kernels"] = "remeasured" if failed else "cached"
        self.choices["bucket_kernels"] = {b: attn.bucket_kernel[b] for b in buckets}

    def _choose(self, cached: Choices | None) -> None:
        """auto: per bucket, the cached path where its graph was captured (and so checked against eager), else time
        both paths on a padded batch and keep the faster (measured, not guessed)."""
        runner = self.runner
        paths = None if cached is None else cached.get("auto_choice")
        measure = list(self.buckets)
        if paths is not None:
            measure = [b for b in self.buckets if not self._captured(b, paths.get(b))]
            self.choice |= {b: paths[b] for b in self.buckets if b not in measure}
            if measure:
                logger.warning("choice cache: the cached graph paths of buckets %s were not captured; measuring them "
                               "again", measure)  # fmt: skip
                local = [b for b in measure if b not in self.local.buckets and b not in self.local.failed]
                self.full.capture([b for b in measure if b not in self.full.graphs and b not in self.full.failed])
                self.local.capture(runner.cfg.hidden_size, runner.dtype, runner.device, local)
            self.choice_sources["auto_choice"] = "remeasured" if measure else "cached"
        else:
            self.choice_sources["auto_choice"] = "measured"
        for size in measure:
            full_ok = size in self.full.graphs
            local_ok = size in self.local.buckets
            if not (full_ok and local_ok):
                self.choice[size] = "full_decode" if full_ok else "local_mlp"
                continue
            padding = runner.padding_batch(size)
            inputs = padding.to_device(runner.device)
            with runner.slots.preserved([runner.slots.scratch]):
                t_full = median_ms(lambda padding=padding: self.full.run(padding))
                hook = self.local.step_hook(size)
                t_local = median_ms(lambda p=padding, x=inputs, h=hook: self._bucket_step(p, x, h))
            self.choice[size] = "full_decode" if t_full <= t_local else "local_mlp"
            self.timings.append(
                {"bucket": size, "full_decode_ms": t_full, "local_mlp_ms": t_local, "chosen": self.choice[size]}
            )
        self.choices["auto_choice"] = {b: self.choice[b] for b in self.buckets}
        table = ", ".join(
            f"{t['bucket']}: full {t['full_decode_ms']:.2f} / local {t['local_mlp_ms']:.2f} ms" for t in self.timings
        )
        logger.info("auto graph mode per bucket: %s", table or "cached, or only one path available")

    def _captured(self, size: int, path: str | None) -> bool:
        """Whether bucket ``size`` has a captured (and checked) graph of ``path``."""
        return (path == "full_decode" and size in self.full.graphs) or (
            path == "local_mlp" and size in self.local.buckets
        )

    def _keep_choices(self, key: dict | None, cached: Choices | None) -> None:
        """Sum up where the choices came from, and write the cache entry unless all of it was read and passed."""
        sources = set(self.choice_sources.values())
        if not sources:
            return  # nothing was chosen: nothing to keep
        if sources == {"cached"}:
            self.choices_source = "cached"
        else:
            self.choices_source = "measured" if cached is None else "remeasured"
        if key is None:
            return
        if self.choices_source == "cached":
            self.choice_file = self.choice_cache.path(key)
        else:
            self.choice_file = self.choice_cache.store(key, self.choices)

    def _kernel_step(self, batch: StepBatch) -> Callable[[], Tensor]:
        """The whole decode step (embedding, layers, head, sampler, state update) of a planned synthetic batch,
        as the decode-kernel measurement times it; every request on the scratch slot (the caller keeps its
        state)."""
        runner = self.runner
        inputs = replace(batch, slots=[runner.slots.scratch] * batch.num_reqs).to_device(runner.device)
        return lambda: runner.forward(inputs)

    def _bucket_step(self, padded: StepBatch, inputs, hook) -> Tensor:
        """A padded decode step without a full-decode graph: the bucket's attention buffers, then the runner's
        forward (with the local MLP graph hook, or none)."""
        self.runner.attn.plan_bucket(padded)
        return self.runner.forward(inputs, hook)

    def path_for(self, size: int) -> str:
        """The path a decode batch of bucket ``size`` takes: full_decode, local_mlp or eager."""
        full = self.full is not None and size in self.full.graphs
        if full and (self.mode is not GraphMode.AUTO or self.choice.get(size) == "full_decode"):
            return "full_decode"
        if self.local is not None and size in self.local.buckets:
            return "local_mlp"
        return "eager"

    def prefill_bucket_for(self, batch: StepBatch) -> int | None:
        """The token bucket a prefill batch is padded to (None: it runs unpadded): the smallest that holds its
        tokens (its queries: a prefix-cache hit's cached context is read, not computed) and whose buffers hold its
        contexts' KV pages."""
        size = bucket_for(batch.num_tokens, self.prefill_buckets)
        if size is None:
            return None
        bs, attn = self.runner.block_size, self.runner.attn
        pages = sum(-(-n // bs) for n in batch.seq_lens) + -(-(size - batch.num_tokens) // bs)
        return size if pages <= attn.prefill_pages(size, self.runner.prefill_requests(size)) else None

    def run(self, batch: StepBatch) -> Tensor:
        """One step -> rows [B, C + 1] (codes, done flag)."""
        if not batch.is_decode:
            return self._run_prefill(batch)
        runner = self.runner
        assert not batch.new_slots, "decode steps run requests that are already running"
        b = batch.num_reqs
        size = bucket_for(b, self.buckets)
        if size is None:
            return runner.run(batch)
        padded = runner.padded(batch, size)
        path = self.path_for(size)
        if path == "full_decode":
            return self.full.run(padded)[:b]
        hook = self.local.step_hook(size) if path == "local_mlp" else None
        return self._bucket_step(padded, padded.to_device(runner.device), hook)[:b]

    def _run_prefill(self, batch: StepBatch) -> Tensor:
        runner = self.runner
        size = self.prefill_bucket_for(batch)
        if size is None:
            return runner.run(batch)
        padded = runner.padded_prefill(batch, size)
        runner.slots.reset(padded.new_slots)
        if self.prefill is not None and size in self.prefill.graphs:
            return self.prefill.run(padded)[: batch.num_reqs]
        runner.attn.plan_prefill_bucket(padded)  # the bucket's kernels and plan, eagerly
        return runner.forward(padded.to_device(runner.device))[: batch.num_reqs]

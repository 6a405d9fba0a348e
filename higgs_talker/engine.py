"""The engine: continuous batching, the step loop, and the only owner of requests and their device state.

One ``step()`` is either a prefill of newly admitted (or resumed) requests or a decode step of every running
request (one token each). Per request and step it publishes an owned ``[1, N]`` int32 row of the codes just
sampled. Decode state lives in dense device tensors indexed by a *state row* that the engine assigns to a
request id at admission and takes back when it finishes, so reordering, joining and finishing requests never
moves another request's state.

When the KV cache runs out during decode, the most recently admitted request is preempted: its blocks are
freed and it is re-queued; on resume its prompt and every generated position (each embedded from the row
fed back there) are recomputed in one prefill, so its codes do not change.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import numpy as np
import torch
from torch import Tensor

from .attention import AttentionBackend, AttnMetadata, SdpaAttention
from .config import SpecialTokens, TalkerConfig
from .heads.delay import DelayState, apply_delay_mask, update_state
from .heads.sampling import SamplingParams, sample_codes
from .kv_cache import BlockAllocator, allocate_kv_caches, kv_bytes_per_token, slot_mapping
from .model import TalkerModel
from .prompt import Prompt
from .request import DecodeInputs, EngineConfig, Request, Status, StepOutput

logger = logging.getLogger(__name__)

__all__ = ["DecodeInputs", "Engine", "EngineConfig", "Request", "Status", "StepOutput"]


class Engine:
    def __init__(
        self,
        model: TalkerModel,
        cfg: TalkerConfig,
        specials: SpecialTokens,
        engine_cfg: EngineConfig | None = None,
        attention: AttentionBackend | None = None,
        decode_kernel: str = "auto",
    ) -> None:
        self.model, self.cfg, self.specials = model, cfg, specials
        self.ecfg = ec = engine_cfg or EngineConfig()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_model_len = min(ec.max_model_len or cfg.text.max_position_embeddings, cfg.text.max_position_embeddings)
        num_blocks = ec.num_blocks or self._default_num_blocks()
        # one extra block that no request owns: padded graph rows write their K/V there
        self.allocator = BlockAllocator(num_blocks + 1, ec.block_size)
        self.scratch_block = self.allocator.allocate(1)[0]
        self.kv_caches = allocate_kv_caches(cfg.text, num_blocks + 1, ec.block_size, self.dtype, self.device)
        self.max_blocks_per_seq = -(-self.max_model_len // ec.block_size)
        self.attn = attention or self._default_attention(decode_kernel)
        self.graphs = None  # a cuda_graphs.runner.GraphRunner after warm_up()

        # one extra state row that no request owns: padded graph rows read and write it
        r, dev = ec.max_num_seqs + 1, self.device
        self.scratch_row = ec.max_num_seqs
        self.state = DelayState.allocate(r, cfg.num_codebooks, cfg.boc_id, dev)
        self.temperature = torch.ones(r, device=dev)
        self.top_k = torch.full((r,), cfg.codebook_size, dtype=torch.long, device=dev)
        self.top_p = torch.ones(r, device=dev)
        self.seeds = torch.zeros(r, dtype=torch.long, device=dev)
        self.min_frames = torch.zeros(r, dtype=torch.long, device=dev)
        self._free_rows = list(range(ec.max_num_seqs - 1, -1, -1))

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.num_steps = 0

    def _default_num_blocks(self) -> int:
        """Enough blocks for max_num_seqs full-length sequences; on CUDA at most what ``kv_memory_fraction`` of
        the free device memory holds (the rest stays for activations, graphs and workspaces)."""
        ec = self.ecfg
        want = ec.max_num_seqs * -(-self.max_model_len // ec.block_size)
        if self.device.type != "cuda":
            return want
        free, _ = torch.cuda.mem_get_info(self.device)
        per_block = kv_bytes_per_token(self.cfg.text, self.dtype) * ec.block_size
        fits = int(free * ec.kv_memory_fraction) // per_block
        if fits < -(-self.max_model_len // ec.block_size):
            raise ValueError(
                f"the KV cache for one {self.max_model_len}-token sequence does not fit in "
                f"{ec.kv_memory_fraction:.0%} of the free GPU memory ({free / 2**30:.1f} GiB); lower max_model_len"
            )
        if fits < want:
            logger.info(
                "KV cache: %d blocks (%.1f GiB) fit, fewer than the %d for %d full-length sequences",
                fits,
                fits * per_block / 2**30,
                want,
                ec.max_num_seqs,
            )
        return min(want, fits)

    def _default_attention(self, decode_kernel: str) -> AttentionBackend:
        t = self.cfg.text
        if self.device.type == "cuda":
            try:
                from .flashinfer_attention import FlashInferAttention

                return FlashInferAttention(
                    self.kv_caches,
                    t.num_attention_heads,
                    t.num_key_value_heads,
                    t.head_dim,
                    self.max_model_len,
                    self.scratch_block,
                    decode_kernel,
                )
            except ImportError:
                logger.warning(
                    "FlashInfer is not installed: CUDA attention falls back to torch SDPA (pip install "
                    "'higgs-talker[gpu]')"
                )
        return SdpaAttention(self.kv_caches, t.num_attention_heads, t.head_dim)

    @torch.inference_mode()
    def warm_up(self, graph_mode, buckets=None) -> None:
        """CUDA only: measure the decode kernels and capture the graphs ``graph_mode`` needs (before serving)."""
        from .cuda_graphs.buckets import DEFAULT_BUCKETS
        from .cuda_graphs.runner import GraphRunner

        runner = GraphRunner(self, graph_mode, buckets or DEFAULT_BUCKETS)
        if hasattr(self.attn, "kernel_for_bucket"):
            from .flashinfer_attention import measure_decode_kernels

            self.kernel_table = measure_decode_kernels(self.attn, list(runner.buckets))
        runner.warm_up()
        self.graphs = runner

    def eager_post_attention(self, layer: int, hidden: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return self.model.model.layers[layer].post_attention(hidden, residual, self.model.kernels)

    def pad_decode(self, inputs: DecodeInputs, meta: AttnMetadata, size: int) -> tuple[DecodeInputs, AttnMetadata]:
        """A decode batch padded to ``size`` rows; padding rows use the scratch state row and scratch KV block.

        The padded inputs are host-only (``decode_forward`` uploads them; a full-decode graph copies them into
        its static buffers); the metadata keeps device tensors only where ``meta`` had them.
        """
        if size == len(inputs.state_rows_host):
            return inputs, meta
        return inputs.padded(size, self.scratch_row), meta.padded(size, self.scratch_block, self.ecfg.block_size)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt; returns its request id. Raises ``ValueError`` for a prompt that can never fit."""
        if not isinstance(prompt, Prompt):
            raise TypeError(f"prompt must be a Prompt (see HiggsTalker.build_prompt), got {type(prompt).__name__}")
        ids = prompt.input_ids
        if len(prompt) and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.text.vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"prompt token id {bad} is outside the text vocabulary [0, {self.cfg.text.vocab_size})")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(prompt) + 1 > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room within max_model_len={self.max_model_len}")
        if self.allocator.blocks_for(len(prompt) + 1) > self.allocator.num_blocks - 1:  # minus the scratch block
            raise ValueError(
                f"prompt of {len(prompt)} tokens does not fit the KV cache ({self.allocator.num_blocks - 1} blocks)"
            )
        req = Request(request_id, prompt, params, params.resolved_seed(), submitted_at=time.perf_counter())
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Stop a request now, freeing its KV blocks and state row. Returns False if it was not live."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "cancelled")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_finished(self, request_id: str) -> Request:
        """Forget a finished request and return it (its rows and timings)."""
        req = self.requests[request_id]
        if req.status is not Status.FINISHED:
            raise ValueError(f"request {request_id!r} has not finished")
        return self.requests.pop(request_id)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one prefill or decode step; returns one output per request that took part (or finished)."""
        outputs: list[StepOutput] = []
        prefill = self._schedule_prefill()
        if prefill:
            t0 = time.perf_counter()
            try:
                rows = self._run_prefill(prefill)
            except BaseException:
                for req in prefill:  # never decode a request whose prefill did not complete
                    self._finish(req, "error")
                raise
            outputs += self._publish(prefill, rows)
            ms = (time.perf_counter() - t0) * 1e3
            for req in prefill:
                req.prefill_ms += ms
        elif self.running:
            batch = self._schedule_decode(outputs)
            if batch:
                try:
                    rows = self._run_decode(batch)
                except BaseException:
                    for req in batch:  # their KV and state may be half-written: do not go on with them
                        self._finish(req, "error")
                    raise
                outputs += self._publish(batch, rows)
        self.num_steps += 1
        return outputs

    def _schedule_prefill(self) -> list[Request]:
        batch, tokens = [], 0
        while self.waiting and self._free_rows:
            req = self.waiting[0]
            n = req.num_tokens + (1 if req.rows else 0)  # a resumed request also recomputes its last fed row
            need = self.allocator.blocks_for(n + 1)  # room for the first decode token too
            if batch and tokens + n > self.ecfg.max_prefill_tokens:
                break
            if not self.allocator.can_allocate(need):
                break
            self.waiting.popleft()
            req.blocks = self.allocator.allocate(need)
            if req.state_row < 0:
                req.state_row = self._free_rows.pop()
                self._init_state_row(req)
            req.status = Status.RUNNING
            batch.append(req)
            tokens += n
        if not batch and self.waiting and not self.running and not self._free_rows:
            raise RuntimeError("no free state rows and nothing running")  # internal invariant
        if not batch and self.waiting and not self.running:
            req = self.waiting.popleft()
            self._finish(req, "error")  # it can never fit: fail it once instead of blocking every later step
            raise RuntimeError(
                f"request {req.id!r} needs {self.allocator.blocks_for(req.num_tokens + 2)} KV blocks but the cache "
                f"has {self.allocator.num_blocks - 1} in all; raise num_blocks or lower max_frames"
            )
        self.running += batch
        return batch

    def _schedule_decode(self, outputs: list[StepOutput]) -> list[Request]:
        """Give every running request room for one more token, preempting the newest when blocks run out."""
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue
            if req.num_computed + 1 > self.max_model_len:
                self._finish(req, "max_model_len")
                outputs.append(StepOutput(req.id, None, True, "max_model_len"))
                continue
            while len(req.blocks) * self.ecfg.block_size < req.num_computed + 1:
                if self.allocator.can_allocate(1):
                    req.blocks += self.allocator.allocate(1)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
        return [r for r in self.running if r.status is Status.RUNNING]

    def _preempt(self, req: Request) -> None:
        self.allocator.free(req.blocks)
        req.blocks, req.num_computed = [], 0
        req.status = Status.WAITING
        req.preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        logger.debug("preempted request %s (KV cache full)", req.id)

    def _init_state_row(self, req: Request) -> None:
        row = req.state_row
        rows = torch.tensor([row], device=self.device)
        self.state.reset(rows, self.cfg.boc_id)
        p = req.params
        self.temperature[row] = float(p.temperature)
        self.top_k[row] = p.top_k if p.top_k > 0 else self.cfg.codebook_size
        self.top_p[row] = float(p.top_p)
        self.seeds[row] = req.seed
        self.min_frames[row] = p.min_frames

    # ------------------------------------------------------------------ model work

    def _attn_metadata(self, batch: list[Request], query_lens: list[int], device_tensors: bool = True) -> AttnMetadata:
        """The step's attention metadata; ``device_tensors=False`` leaves the device tensors out (host lists only)."""
        bs = self.ecfg.block_size
        slots: list[int] = []
        seq_lens = []
        for req, n in zip(batch, query_lens, strict=True):
            slots += slot_mapping(req.blocks, req.num_computed, req.num_computed + n, bs)
            seq_lens.append(req.num_computed + n)
        meta = AttnMetadata(
            slot_mapping=None,
            query_start_loc=None,
            seq_lens=None,
            block_tables=None,
            query_lens_host=list(query_lens),
            seq_lens_host=seq_lens,
            slot_mapping_host=slots,
            blocks_host=[list(r.blocks) for r in batch],
        )
        if device_tensors:
            tables = np.zeros((len(batch), self.max_blocks_per_seq), dtype=np.int32)
            for i, req in enumerate(batch):
                tables[i, : len(req.blocks)] = req.blocks
            dev = self.device
            meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
            meta.query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=dev)
            meta.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
            meta.block_tables = torch.from_numpy(tables).to(dev)
        return meta

    def _prefill_embeds(self, req: Request) -> Tensor:
        """Embeddings of every position to (re)compute: prompt (+ reference rows) and fed-back rows."""
        p = req.prompt
        ids = p.input_ids.to(self.device)
        embeds = self.model.embed_text(ids)
        if p.audio_codes is not None:
            ref = self.model.multimodal_embedding(p.audio_codes.to(self.device))
            embeds = embeds.index_copy(0, p.audio_positions.to(self.device), ref.to(embeds.dtype))
        if req.rows:  # resume after preemption: position P + j - 1 was fed row j - 1
            fed = torch.stack(req.rows).to(self.device)
            embeds = torch.cat([embeds, self.model.multimodal_embedding(fed).to(embeds.dtype)])
        return embeds

    def _run_prefill(self, batch: list[Request]) -> Tensor:
        embeds = [self._prefill_embeds(r) for r in batch]
        lens = [e.shape[0] for e in embeds]
        positions = torch.cat([torch.arange(len_, device=self.device) for len_ in lens])
        meta = self._attn_metadata(batch, lens)
        self.attn.begin(meta)
        hidden = self.model(torch.cat(embeds), positions, self.attn)
        last = hidden[meta.query_start_loc[1:].long() - 1]  # [B, H]
        for req, n in zip(batch, lens, strict=True):
            req.num_computed += n
        rows = torch.tensor([r.state_row for r in batch], device=self.device)
        steps = torch.tensor([len(r.rows) for r in batch], device=self.device)
        return self._sample(last, rows, steps, *self._sampling_flags(batch))

    def decode_inputs(self, batch: list[Request]) -> DecodeInputs:
        """Host-only inputs of a decode step (``decode_forward`` uploads them in one copy)."""
        return DecodeInputs.from_host(
            [r.state_row for r in batch],
            [r.num_computed for r in batch],
            [len(r.rows) for r in batch],
            *self._sampling_flags(batch),
        )

    def _sampling_flags(self, batch: list[Request]) -> tuple[bool, bool]:
        """(draw, filter) for a batch, from host-side params: lets eager steps skip work no row needs.

        Skipping is exact: an inactive top-k/top-p filter masks nothing, and greedy rows take the argmax either
        way. Graphs are captured with both on, so they serve any batch.
        """
        v = self.cfg.codebook_size
        sampled = [r.params for r in batch if r.params.temperature > 0]
        return bool(sampled), any(0 < p.top_k < v or p.top_p < 1 for p in sampled)

    def _run_decode(self, batch: list[Request]) -> Tensor:
        inputs = self.decode_inputs(batch)
        meta = self._attn_metadata(batch, [1] * len(batch), not getattr(self.attn, "plans_from_host", False))
        if self.graphs is not None:
            rows = self.graphs.decode(inputs, meta)
        else:
            self.attn.begin(meta)
            rows = self.decode_forward(inputs)
        for req in batch:
            req.num_computed += 1
        return rows

    def decode_forward(self, inputs: DecodeInputs, post_attention=None) -> Tensor:
        """One decode step on device tensors only (graph-safe): feedback -> model -> heads -> sample -> state.

        Returns the emitted rows [B, N] int64.
        """
        st = self.state
        inputs = inputs.to_device(self.device)  # a graph's static inputs are already there
        b = inputs.state_rows.shape[0]
        audio = torch.full((b,), self.specials.audio, dtype=torch.long, device=self.device)
        text = self.model.embed_text(audio)
        rows = inputs.state_rows
        fed = self.model.multimodal_embedding(st.last_codes.index_select(0, rows)).to(text.dtype)
        embeds = torch.where(st.has_codes.index_select(0, rows)[:, None], fed, text)  # audio feedback
        hidden = self.model(embeds, inputs.positions, self.attn, post_attention)
        return self._sample(hidden, rows, inputs.steps, inputs.draw, inputs.filter)

    def _sample(
        self, last_hidden: Tensor, rows: Tensor, steps: Tensor, draw: bool = True, filter: bool = True
    ) -> Tensor:
        """last_hidden [B, H] -> [B, N + 1] int64: the emitted rows and a done flag; updates the state in place."""
        cfg = self.cfg
        logits = self.model.modality_head(last_hidden).float()  # [B, N, V]
        state = self.state.gather(rows)
        eoc_allowed = steps >= self.min_frames.index_select(0, rows)  # steps: the row index about to be produced
        apply_delay_mask(logits, state.delay, state.countdown, cfg.boc_id, cfg.eoc_id, eoc_allowed)
        codes = sample_codes(
            logits,
            self.temperature.index_select(0, rows),
            self.top_k.index_select(0, rows),
            self.top_p.index_select(0, rows),
            self.seeds.index_select(0, rows),
            steps,
            draw=draw,
            filter=filter,
        )
        active = torch.ones_like(state.done)
        emitted, new = update_state(codes, state, active, cfg.boc_id, cfg.eoc_id)
        self.state.scatter(rows, new)
        return torch.cat([emitted, new.done[:, None].long()], dim=1)

    # ------------------------------------------------------------------ results

    def _publish(self, batch: list[Request], out: Tensor) -> list[StepOutput]:
        """out [B, N + 1] (rows + done flag) -> per-request outputs; the one host sync of the step."""
        with torch.inference_mode(False):  # ordinary tensors, which callers may modify
            host = out.to("cpu", torch.int32)
            rows, done = host[:, :-1], host[:, -1].tolist()
            published = rows.clone().split(1)  # [1, N] each; not shared with req.rows, so callers may modify them
            kept = rows.unbind(0)  # [N] each, one call instead of B indexing ops
        now = time.perf_counter()
        outputs = []
        for i, req in enumerate(batch):
            req.rows.append(kept[i])
            if req.first_row_at is None:
                req.first_row_at = now
            reason = None
            if done[i]:
                reason = "eoc"
            elif len(req.rows) >= req.params.max_frames:
                reason = "max_frames"
            elif req.num_tokens + 1 > self.max_model_len:
                reason = "max_model_len"
            if reason:
                self._finish(req, reason)
            outputs.append(StepOutput(req.id, published[i], reason is not None, reason))
        return outputs

    def _finish(self, req: Request, reason: str) -> None:
        if req.blocks:
            self.allocator.free(req.blocks)
        req.blocks = []
        if req.state_row >= 0:
            self._free_rows.append(req.state_row)
            req.state_row = -1
        if req in self.running:
            self.running.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finished_at = time.perf_counter()

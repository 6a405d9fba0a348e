"""The model class vLLM / vllm-omni instantiate for Higgs-Audio V3 Stage 0: a thin adapter over the core.

vLLM owns the backbone (its ``Qwen3Model``: attention, KV cache, batching, compile boundary); the core owns
everything audio (``heads/``: fused codebook embedding/head, delay masks, sampling, delay state) and the
checkpoint names (``checkpoint.map_key``). This class translates between them and implements the vllm-omni
runner contract (SPEC 6):

    update_decode_step_metadata(req_ids, ...)   before every forward: batch order -> pooled state slots
    forward(...)                                text embedding, voice-clone reference rows, audio feedback
    compute_logits(hidden)                      stash the rows; forced tokens only on pure audio steps
    sample(logits, sampling_metadata)           forced <|audio|>/EOS + 8 codes per row (per-request params)
    postprocess / post_sample_multimodal_outputs / make_omni_output   owned [1, 8] ``codes.audio`` rows
    on_requests_finished(ids)                   frees the requests' state

Under plain vLLM (no vllm-omni runner) the ``TextOnlyBridge`` logits processor (``bridge.py``) plays the
runner's part. The local MLP graph path is switched by ``cuda_graphs.policy.decide(vllm_config=...)``.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.v1.outputs import SamplerOutput

from ..checkpoint import expected_shapes, map_key
from ..config import SpecialTokens, TalkerConfig
from ..cuda_graphs.policy import decide
from ..heads.codebooks import build_codebooks
from ..heads.sampling import MAX_SEED
from . import step as S
from .graphs import LocalMLPPath
from .state import RequestStatePool

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet = weakref.WeakSet()
_QKV_SHARDS = ("q", "k", "v")


def live_talkers() -> list[HiggsTalkerForConditionalGeneration]:
    """The adapters alive in this process (the text-only bridge and tests find the model through this)."""
    return list(_LIVE)


class HiggsTalkerForConditionalGeneration(nn.Module):
    """Higgs-Audio V3 talker for vLLM: ``__init__(*, vllm_config, prefix="")``."""

    # vllm-omni runner contract (SPEC 6.1)
    prefer_model_sampler = True
    have_multimodal_outputs = True
    has_postprocess = True
    postprocess_uses_hidden_states = False
    postprocess_uses_multimodal_outputs = False
    postprocess_uses_req_infos = False
    skips_model_sampler_output_token_history = True
    supports_omni_query_start_loc = True
    omni_pooler_payload_include_hidden = False
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf = vllm_config.model_config.hf_config
        raw = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
        self.cfg = cfg = TalkerConfig.from_dict(raw)
        t = cfg.text
        self.vllm_config = vllm_config
        self.model = Qwen3Model(vllm_config=_backbone_config(vllm_config, cfg), prefix=_join(prefix, "model"))
        if t.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(t.vocab_size, t.hidden_size, prefix=_join(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(t.vocab_size)
        self.multimodal_embedding, self.modality_head = build_codebooks(cfg)
        device = self.multimodal_embedding.weight.device
        sched = vllm_config.scheduler_config
        max_seqs = max(1, int(getattr(sched, "max_num_seqs", 64) or 64))
        self.pool = RequestStatePool(max(64, max_seqs), cfg.num_codebooks, cfg.boc_id, device)
        # per-token feedback buffers (fixed storage: a vLLM FULL decode graph captures them)
        capture = getattr(vllm_config.compilation_config, "cudagraph_capture_sizes", None) or []
        self._fb_capacity = max([max_seqs, *capture]) + 1
        self._fb_use = torch.zeros(self._fb_capacity, dtype=torch.bool, device=device)
        self._fb_codes = torch.zeros(self._fb_capacity, cfg.num_codebooks, dtype=torch.long, device=device)
        self.specials: SpecialTokens | None = None
        self.loaded_weight_names: frozenset[str] = frozenset()
        # what the steps did (tests and logs read these): text head skipped/computed, frames sampled
        self.stats = {"text_head_skipped": 0, "text_head_full": 0, "sample_steps": 0, "bridge_moves": 0}
        self.supports_omni_decode_step_metadata = True
        self.requires_full_prefix_cached_hidden_states = False
        self.deferred_prefix_cache_mm_keys = {"codes.audio"}
        self._batch: S.StepBatch | None = None  # the current step (None: a dummy/profile run)
        self._bridge_req_ids: list[str] | None = None
        self._pending: tuple[Tensor, S.RowModes] | None = None
        self._published: list[Tensor | None] = []
        self._cursor = 0
        self.graph_decision = decide(vllm_config=vllm_config)
        logger.info("higgs talker (vLLM adapter): %s", self.graph_decision.reason)
        self.local_mlp = LocalMLPPath(self.model, self.graph_decision.local_mlp, max_seqs)
        _LIVE.add(self)

    # ------------------------------------------------------------------ per-step metadata

    def update_decode_step_metadata(
        self,
        *,
        input_ids: Tensor | None = None,
        positions: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        omni_query_start_loc: Tensor | None = None,
        req_ids: list[str] | None = None,
        **_: Any,
    ) -> None:
        """Called by the vllm-omni runner before every forward (outside any graph replay)."""
        if req_ids is None or input_ids is None or positions is None or omni_query_start_loc is None:
            self._batch = None
            self._fb_use.zero_()
            return
        self._begin_step(list(req_ids), input_ids, positions, omni_query_start_loc)

    def set_bridge_requests(self, req_ids: list[str], seeds: dict[int, int]) -> None:
        """The text-only bridge's view of the batch (called before the forward of a real step)."""
        self._bridge_req_ids = list(req_ids)
        self.pool.sync(self._bridge_req_ids, seeds)

    def _begin_step(self, req_ids: list[str], input_ids: Tensor, positions: Tensor, qsl: Tensor) -> None:
        n = len(req_ids)
        qsl = qsl[: n + 1].long()
        slots, new_rows = self.pool.sync(req_ids)
        self._batch = S.StepBatch(req_ids, slots, qsl, input_ids.long(), positions.long(), new_rows)
        if input_ids.shape[0] <= self._fb_capacity:
            S.write_feedback(self._batch, self.pool, self._fb_use, self._fb_codes)

    def on_requests_finished(self, finished_req_ids) -> None:
        self.pool.release(finished_req_ids)

    # ------------------------------------------------------------------ forward

    def embed_input_ids(self, input_ids: Tensor, **_: Any) -> Tensor:
        """Text embedding (placeholder ids < 0 embed as 0 and are replaced later)."""
        return self.model.embed_input_ids(input_ids.clamp(min=0))

    def forward(
        self,
        input_ids: Tensor | None,
        positions: Tensor,
        intermediate_tensors=None,
        inputs_embeds: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """Scheduled tokens [T] -> final hidden [T, H]."""
        if self._bridge_req_ids is not None and input_ids is not None:
            self._begin_bridge_step(input_ids, positions)
        embeds = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        batch = self._batch
        if batch is not None:
            infos = kwargs.get("model_intermediate_buffer") or kwargs.get("runtime_additional_information")
            if infos:
                embeds = self._substitute_reference(embeds, batch, infos)
        if embeds.shape[0] <= self._fb_capacity:
            # always, even in dummy runs: a FULL decode graph captured here must contain the feedback
            embeds = S.apply_feedback(embeds, self._fb_use, self._fb_codes, self.multimodal_embedding)
        elif batch is not None:
            embeds = S.feedback_sparse(embeds, batch, self.pool, self.multimodal_embedding)
        hidden = self.local_mlp.forward(positions, embeds, batch is not None and _pure_decode(batch, embeds))
        if hidden is None:
            hidden = self.model(None, positions, intermediate_tensors, inputs_embeds=embeds)
        return hidden

    def _begin_bridge_step(self, input_ids: Tensor, positions: Tensor) -> None:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        qsl = None
        if is_forward_context_available():
            meta = get_forward_context().attn_metadata
            if isinstance(meta, dict):
                meta = next(iter(meta.values()), None)
            qsl = getattr(meta, "query_start_loc", None)
        req_ids, self._bridge_req_ids = self._bridge_req_ids, None
        if qsl is None or qsl.shape[0] < len(req_ids) + 1:
            self._batch = None
            return
        self._begin_step(req_ids, input_ids, positions, qsl.to(input_ids.device))

    def _substitute_reference(self, embeds: Tensor, batch: S.StepBatch, infos: list) -> Tensor:
        """Voice clone: placeholder positions of a prefill span embed their delayed reference rows (SPEC 3.4)."""
        qsl = batch.qsl.tolist()
        for i, info in enumerate(infos[: batch.num_reqs]):
            if not isinstance(info, dict) or info.get("audio_input_ids") is None:
                continue
            start, end = qsl[i], qsl[i + 1]
            if end - start <= 1:
                continue
            codes, where = _reference_rows(info, self.cfg.num_codebooks)
            if codes is None or where is None:
                continue
            pos = batch.positions[start:end].to(where.device)
            idx = torch.searchsorted(where, pos).clamp(max=where.numel() - 1)
            hit = where[idx] == pos
            if not bool(hit.any()):
                continue
            tok = torch.nonzero(hit).flatten()
            rows = self.multimodal_embedding(codes[idx[tok]].to(embeds.device)).to(embeds.dtype)
            embeds = embeds.index_copy(0, tok.to(embeds.device) + start, rows)
        return embeds

    # ------------------------------------------------------------------ logits and sampling

    def compute_logits(self, hidden_states: Tensor, sampling_metadata: Any = None) -> Tensor | None:
        """hidden [B, H] -> text logits [B, V]; audio-mode rows keep only their forced token."""
        batch = self._batch
        if batch is None or self.specials is None or hidden_states.shape[0] != batch.num_reqs:
            self._pending = None
            return self.logits_processor(self.lm_head, hidden_states)
        sp = self.specials
        modes = S.row_modes(batch, self.pool, sp.audio, sp.eos)
        self._pending = (hidden_states, modes)
        if self.pool.all_forced(batch.req_ids):  # pure audio step: the text head is not computed
            self.stats["text_head_skipped"] += 1
            return S.forced_only_logits(modes, self.cfg.text.vocab_size, hidden_states.dtype)
        self.stats["text_head_full"] += 1
        logits = self.logits_processor(self.lm_head, hidden_states)
        return S.force_text_logits(logits, modes)

    def sample(self, logits: Tensor, sampling_metadata: Any) -> SamplerOutput | None:
        """The vllm-omni model sampler: forced text tokens and this step's codes (None: use vLLM's sampler)."""
        if self._pending is None or self._batch is None:
            return None
        batch = self._batch
        for i, gen in (getattr(sampling_metadata, "generators", None) or {}).items():
            if i in batch.new_rows:
                self.pool.set_seed(batch.req_ids[i], gen.initial_seed() % (MAX_SEED + 1))
        b = batch.num_reqs
        t, k, p = S.step_params(
            b,
            self.cfg.codebook_size,
            logits.device,
            sampling_metadata.temperature,
            sampling_metadata.top_k,
            sampling_metadata.top_p,
        )
        modes = self._pending[1]
        forced_only = self.pool.all_forced(batch.req_ids) or bool(modes.audio.all())
        self.sample_codes(t, k, p)
        if forced_only and sampling_metadata.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=modes.forced.to(torch.int32)[:, None], logprobs_tensors=None)
        from vllm.v1.sample.sampler import Sampler

        if not hasattr(self, "_text_sampler"):
            self._text_sampler = Sampler()
        return self._text_sampler(logits, sampling_metadata)

    def sample_codes(self, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> list[Tensor | None]:
        """Sample this step's frames for the stashed rows; returns per request an owned [1, N] row or None."""
        if self._pending is None or self._batch is None:
            return []
        hidden, modes = self._pending
        batch, self._pending = self._batch, None
        self.stats["sample_steps"] += 1
        emitted, new = S.sample_step(
            hidden, batch, modes, self.pool, self.modality_head, self.cfg, temperature, top_k, top_p
        )
        host = torch.cat([emitted, modes.code_rows[:, None], new.has_codes[:, None], new.done[:, None]], dim=1)
        host = host.to("cpu", torch.int32)  # the one host sync of the step
        n = self.cfg.num_codebooks
        self._published = self.pool.record(
            batch.req_ids, host[:, :n], host[:, n].bool(), host[:, n + 1].bool(), host[:, n + 2].bool()
        )
        self._cursor = 0
        self._batch = None  # consumed: a dummy run before the next step's metadata sees no batch
        return self._published

    # ------------------------------------------------------------------ publishing codes.audio

    def postprocess(self, hidden_states: Tensor, multimodal_outputs: Any = None, **_: Any) -> dict:
        """vllm-omni 0.30: called once per request in batch order after sampling; this step's owned row."""
        i, self._cursor = self._cursor, self._cursor + 1
        row = self._published[i] if i < len(self._published) else None
        return {"codes": {"audio": row}} if row is not None else {}

    def post_sample_multimodal_outputs(self, *, req_ids, invalid_req_indices=(), multimodal_outputs=None, **_):
        """Newer vllm-omni runners: this step's owned [1, N] rows by request (empty [0, N] where none)."""
        invalid = set(invalid_req_indices or ())
        empty = torch.zeros(0, self.cfg.num_codebooks, dtype=torch.int32)
        rows = [
            row
            if (i < len(self._published) and (row := self._published[i]) is not None and i not in invalid)
            else empty
            for i in range(len(req_ids))
        ]
        return {"codes": {"audio": rows}}

    def make_omni_output(self, model_outputs: Any, **kwargs: Any):
        """Wrap the hidden states with the per-request ``codes.audio`` the runner buffered (vllm-omni 0.30)."""
        from vllm_omni.model_executor.models.output_templates import OmniOutput

        if isinstance(model_outputs, OmniOutput):
            return model_outputs
        infos = kwargs.get("model_intermediate_buffer") or kwargs.get("runtime_additional_information") or []
        rows, any_rows = [], False
        for info in infos:
            codes = (info.get("codes") or {}).get("audio") if isinstance(info, dict) else None
            if isinstance(codes, Tensor) and codes.numel():
                rows.append(codes)
                any_rows = True
            else:
                rows.append(torch.zeros(0, self.cfg.num_codebooks, dtype=torch.int32))
        mm = {"codes": {"audio": rows}} if any_rows else None
        return OmniOutput(text_hidden_states=model_outputs, multimodal_outputs=mm)

    def request_rows(self, req_id: str) -> Tensor | None:
        """Every delayed row [R, N] int32 a request produced so far, live or recently finished (text-only
        bridge path keeps the last 256 finished requests); None for an unknown id."""
        req = self.pool.requests.get(req_id)
        return self.pool.rows_of(req) if req is not None else self.pool.finished.get(req_id)

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Checkpoint-named tensors -> parameters (packed q/k/v and gate/up through vLLM's loaders).

        Returns the parameter names loaded. Raises ValueError for an unexpected key (``map_key``), a key
        whose parameter does not exist, a missing required key, or a parameter left unfilled.
        """
        params = dict(self.named_parameters())
        seen: set[str] = set()
        loaded: set[str] = set()
        for key, tensor in weights:
            target = map_key(key, self.cfg)
            seen.add(key)
            if target is None:
                continue
            param = params.get(target.param)
            if param is None:
                raise ValueError(f"checkpoint key {key!r} maps to {target.param!r}, which the model does not have")
            loader = getattr(param, "weight_loader", default_weight_loader)
            if target.shard is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"checkpoint key {key!r} has shape {list(tensor.shape)}, expected {list(param.shape)}"
                    )
                loader(param, tensor)
            else:
                shard = _QKV_SHARDS[target.shard] if ".qkv_proj." in target.param else target.shard
                loader(param, tensor, shard)
            loaded.add(target.param)
        missing = sorted(set(expected_shapes(self.cfg)) - seen)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} required key(s): {', '.join(missing)}")
        unfilled = sorted(set(params) - loaded)
        if unfilled:
            raise ValueError(f"checkpoint does not fill model parameter(s): {', '.join(unfilled)}")
        self.specials = _resolve_specials(self.vllm_config, self.cfg)
        self.local_mlp.capture(self.cfg.text.hidden_size, self.multimodal_embedding.weight)
        self.loaded_weight_names = frozenset(loaded)
        return loaded


# ---------------------------------------------------------------------------------------------------------


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _pure_decode(batch: S.StepBatch, embeds: Tensor) -> bool:
    return embeds.shape[0] == batch.num_reqs


def _backbone_config(vllm_config: VllmConfig, cfg: TalkerConfig) -> VllmConfig:
    """A shallow copy of the vLLM config whose model config describes only the Qwen3 backbone."""
    text = cfg.text.to_qwen3_config()
    out = copy.copy(vllm_config)
    model_config = copy.copy(vllm_config.model_config)
    model_config.hf_config = text
    model_config.hf_text_config = text
    out.model_config = model_config
    return out


def _resolve_specials(vllm_config: VllmConfig, cfg: TalkerConfig) -> SpecialTokens:
    from ..prompt import TalkerTokenizer

    mc = vllm_config.model_config
    path = getattr(mc, "tokenizer", None) or mc.model
    if not Path(str(path)).exists():
        path = mc.model
    return TalkerTokenizer.from_pretrained(path, cfg).specials


def _reference_rows(info: dict, num_codebooks: int) -> tuple[Tensor | None, Tensor | None]:
    """(delayed reference rows [R, N] int64, sorted placeholder positions [R] int64) from a request's info."""
    codes = info.get("audio_input_ids")
    if isinstance(codes, list) and len(codes) == 1:
        codes = codes[0]
    if not isinstance(codes, Tensor):
        codes = torch.as_tensor(codes)
    codes = codes.reshape(-1, num_codebooks).long()
    where = info.get("audio_placeholder_positions")
    if where is None:
        return codes, None
    where = torch.as_tensor(where).reshape(-1).long()
    mask = info.get("audio_input_ids_mask")
    if mask is not None:
        mask = torch.as_tensor(mask).reshape(-1).bool()
        codes, where = codes[mask.to(codes.device)], where[mask.to(where.device)]
    if where.numel() != codes.shape[0] or where.numel() == 0:
        logger.debug(
            "reference rows (%d) and placeholder positions (%d) differ; skipped", codes.shape[0], where.numel()
        )
        return None, None
    where, order = where.sort()
    return codes[order.to(codes.device)], where

"""The model class vLLM / vllm-omni instantiate for Higgs-Audio V3 Stage 0: a translation layer over the core.

vLLM owns the backbone (its ``Qwen3Model``: attention, KV cache, batching, compile boundary, its own graphs); the
core owns everything audio (``heads/``: the fused codebook embedding/head, the decode-state slots and the frame
step) and the checkpoint names (``checkpoint.WeightRouter``). This class translates between them and implements
the vllm-omni runner contract (SPEC 6):

    update_decode_step_metadata(req_ids, ...)   before every forward or graph replay: batch order -> slots
    forward(...)                                text embedding, voice-clone reference rows, audio feedback
    compute_logits(hidden)                      stash the rows; forced tokens only on pure audio steps
    sample(logits, sampling_metadata)           forced <|audio|>/EOS + C codes per row (per-request params)
    postprocess / post_sample_multimodal_outputs / make_omni_output   owned [1, C] ``codes.audio`` rows
    on_requests_finished(ids)                   frees the requests' slots

Under plain vLLM the ``TextOnlyBridge`` logits processor (``bridge.py``) plays the runner's part; it finds this
instance through ``talker_for(vllm_config)`` (keyed by the config's instance id). Release differences are in
``compat.py``; the local MLP graph path is switched by ``cuda_graphs.policy.decide(vllm_config=...)``.
"""

from __future__ import annotations

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

from ..checkpoint import WeightRouter
from ..config import SpecialTokens, TalkerConfig
from ..cuda_graphs.policy import decide
from ..heads.codebooks import build_codebooks
from ..heads.sampling import resolve_seed, row_params
from ..heads.slots import SlotStore
from . import compat
from . import step as S
from .graphs import LocalMLPPath
from .state import RequestSlots

logger = logging.getLogger(__name__)

_QKV_SHARDS = ("q", "k", "v")
_TALKERS: dict[str, weakref.ref] = {}  # vllm_config.instance_id -> the adapter built with that config


def talker_for(vllm_config: Any) -> HiggsTalkerForConditionalGeneration | None:
    """The adapter vLLM built with this config (the bridge's handle on its model), or None."""
    ref = _TALKERS.get(getattr(vllm_config, "instance_id", None) or "")
    return ref() if ref is not None else None


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
    supports_omni_decode_step_metadata = True
    requires_full_prefix_cached_hidden_states = False
    omni_pooler_payload_include_hidden = False
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        compat.check_supported()
        hf = vllm_config.model_config.hf_config
        self.cfg = cfg = TalkerConfig.from_dict(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf))
        t = cfg.text
        self.vllm_config = vllm_config
        backbone = compat.backbone_config(vllm_config, t.to_qwen3_config())
        self.model = Qwen3Model(vllm_config=backbone, prefix=_join(prefix, "model"))
        if t.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(t.vocab_size, t.hidden_size, prefix=_join(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(t.vocab_size)
        # replicated on every tensor-parallel rank: the hidden rows they read are replicated too
        self.multimodal_embedding, self.modality_head = build_codebooks(cfg)
        device = self.multimodal_embedding.weight.device
        max_seqs = compat.max_num_seqs(vllm_config)
        store = SlotStore(max(64, max_seqs), cfg.num_codebooks, cfg.codebook_size, cfg.boc_id, cfg.eoc_id, device)
        self.slots = RequestSlots(store, seed=getattr(vllm_config.model_config, "seed", None))
        # per-token buffers in fixed storage (a vLLM FULL decode graph captures them): feedback, and the step's
        # tokens and positions, which a replay refreshes while our Python forward does not run
        cap = self._capacity = max([max_seqs, *compat.capture_sizes(vllm_config)]) + 1
        self._fb_use = torch.zeros(cap, dtype=torch.bool, device=device)
        self._fb_codes = torch.zeros(cap, cfg.num_codebooks, dtype=torch.long, device=device)
        self._tok_ids = torch.zeros(cap, dtype=torch.long, device=device)
        self._tok_pos = torch.zeros(cap, dtype=torch.long, device=device)
        self.specials: SpecialTokens | None = None
        self.loaded_weight_names: frozenset[str] = frozenset()
        # what the steps did (tests and logs read these)
        self.stats = dict.fromkeys(("text_head_skipped", "text_head_full", "sample_steps", "bridge_moves",
                                    "bridge_replayed_steps", "bridge_no_qsl", "bridge_recomputed_rows"), 0)  # fmt: skip
        self.deferred_prefix_cache_mm_keys = {"codes.audio"}
        self._runner_req_ids: list[str] | None = None  # from prepare_runner_inputs, for the step's metadata
        self._step: S.VllmStep | None = None  # the current step (None: a dummy or profile run)
        self._bridge_req_ids: list[str] | None = None  # set by the bridge before a real step's forward
        self._bridge_infos: list[dict] | None = None  # the bridge's voice-clone references, batch order
        self._pending: tuple[Tensor, S.RowModes] | None = None
        self._published: list[Tensor | None] = []
        self._cursor = 0
        self._text_sampler = None
        self.graph_decision = decide(vllm_config=vllm_config)
        logger.info("higgs talker (vLLM adapter): %s", self.graph_decision.reason)
        self.local_mlp = LocalMLPPath(self.model, self.graph_decision.local_mlp, max_seqs)
        _TALKERS[getattr(vllm_config, "instance_id", "") or ""] = weakref.ref(self)

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
        """Called by the vllm-omni runner before every forward or graph replay (0.26 passes no ``req_ids``: the
        ones ``prepare_runner_inputs`` got for this step stand in; a dummy run has neither)."""
        qsl = omni_query_start_loc
        req_ids, self._runner_req_ids = (req_ids if req_ids is not None else self._runner_req_ids), None
        if req_ids is None or input_ids is None or positions is None or qsl is None:
            self._step = None
            self._fb_use.zero_()
            return
        self._begin_step(list(req_ids), input_ids, positions, qsl)

    def prepare_runner_inputs(self, *, input_ids: Tensor, positions: Tensor, req_ids=None, **_: Any):
        """vllm-omni's AR runner (0.26 and 0.30) names the step's requests here, before its forward; the inputs
        go back unchanged."""
        self._runner_req_ids = None if req_ids is None else list(req_ids)
        return input_ids, positions

    def set_bridge_requests(
        self,
        req_ids: list[str],
        seeds: dict[int, int],
        min_rows: dict[int, int] | None = None,
        references: list[dict] | None = None,
        resume: set[str] | None = None,
    ) -> None:
        """The text-only bridge's view of the batch, before a real step. The feedback buffers are written for a
        pure decode step (token i = request i): a replayed FULL decode graph reads them without our forward;
        an eager forward rewrites them for the step's real layout."""
        self._bridge_req_ids = list(req_ids)
        self._bridge_infos = references if references and any(references) else None
        slots, _ = self.slots.sync(self._bridge_req_ids, seeds, min_rows, resume)
        if len(req_ids) < self._capacity:
            b = len(req_ids)
            decode = S.VllmStep(self._bridge_req_ids, slots, torch.arange(b + 1, device=slots.device), None, None, [])
            S.write_feedback(decode, self.slots, self._fb_use, self._fb_codes)

    def _begin_step(self, req_ids: list[str], input_ids: Tensor, positions: Tensor, qsl: Tensor) -> None:
        n = len(req_ids)
        slots, new_rows = self.slots.sync(req_ids)
        self._step = S.VllmStep(req_ids, slots, qsl[: n + 1].long(), input_ids.long(), positions.long(), new_rows)
        if input_ids.shape[0] <= self._capacity:
            S.write_feedback(self._step, self.slots, self._fb_use, self._fb_codes)

    def on_requests_finished(self, finished_req_ids) -> None:
        self.slots.release(finished_req_ids)

    def on_requests_removed(self, req_ids) -> None:
        """The bridge's requests that left vLLM's batch: finished, or preempted (vLLM does not say which), so
        their slots' state is kept for a resume."""
        self.slots.release(req_ids, keep=True)

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
        t = positions.shape[0]
        if input_ids is not None and t <= self._capacity:  # captured too: a replay refreshes the copies
            self._tok_ids[:t].copy_(input_ids)
            self._tok_pos[:t].copy_(positions)
        if self._bridge_req_ids is not None and input_ids is not None:
            self._begin_bridge_step(input_ids, positions)
        embeds = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        step = self._step
        if step is not None:
            infos = kwargs.get("model_intermediate_buffer") or kwargs.get("runtime_additional_information")
            infos = infos or self._bridge_infos
            if infos:
                embeds = self._substitute_reference(embeds, step, infos)
        if step is not None and embeds.shape[0] > step.num_reqs:  # prefill spans: maybe a recompute
            embeds = self._substitute_fed_rows(embeds, step)
        if embeds.shape[0] <= self._capacity:
            # always, even in dummy runs: a FULL decode graph captured here must contain the feedback
            embeds = S.apply_feedback(embeds, self._fb_use, self._fb_codes, self.multimodal_embedding)
        elif step is not None:
            embeds = S.feedback_sparse(embeds, step, self.slots, self.multimodal_embedding)
        pure_decode = step is not None and embeds.shape[0] == step.num_reqs
        hidden = self.local_mlp.forward(positions, embeds, pure_decode)
        if hidden is None:
            hidden = self.model(None, positions, intermediate_tensors, inputs_embeds=embeds)
        return hidden

    def _begin_bridge_step(self, input_ids: Tensor, positions: Tensor) -> None:
        req_ids, self._bridge_req_ids = self._bridge_req_ids, None
        qsl = compat.step_query_start_loc(len(req_ids), positions)
        if qsl is None:
            self.stats["bridge_no_qsl"] += 1
            compat.warn_once("no-qsl", "the step's request spans are unknown (attention metadata has none): no codes")
            self._step = None
            self._fb_use.zero_()  # no feedback this step rather than feedback on the wrong tokens
            return
        self._begin_step(req_ids, input_ids, positions, qsl)

    def _substitute_reference(self, embeds: Tensor, step: S.VllmStep, infos: list) -> Tensor:
        """Voice clone: placeholder positions of a prefill span embed their delayed reference rows (SPEC 3.4)."""
        qsl = step.qsl.tolist()
        for i, info in enumerate(infos[: step.num_reqs]):
            if not isinstance(info, dict) or info.get("audio_input_ids") is None:
                continue
            start, end = qsl[i], qsl[i + 1]
            if end - start <= 1:
                continue
            codes, where = _reference_rows(info, self.cfg.num_codebooks)
            if codes is None or where is None:
                continue
            pos = step.positions[start:end].to(where.device)
            idx = torch.searchsorted(where, pos).clamp(max=where.numel() - 1)
            hit = where[idx] == pos
            if not bool(hit.any()):
                continue
            tok = torch.nonzero(hit).flatten()
            rows = self.multimodal_embedding(codes[idx[tok]].to(embeds.device)).to(embeds.dtype)
            embeds = embeds.index_copy(0, tok.to(embeds.device) + start, rows)
        return embeds

    def _substitute_fed_rows(self, embeds: Tensor, step: S.VllmStep) -> Tensor:
        """A span vLLM recomputes after a preemption (the prompt and every generated token, from position 0):
        the positions after the prompt's tail embed the rows fed there the first time (position seed_pos + 1 + j
        carried row j), so the recomputed KV and the codes after it are what they would have been."""
        qsl = None
        for i, rid in enumerate(step.req_ids):
            req = self.slots.requests.get(rid)
            if req is None or not req.rows:
                continue
            qsl = step.qsl.tolist() if qsl is None else qsl
            start, end = qsl[i], qsl[i + 1]
            if end - start <= 1:  # a decode step: the dense feedback covers it
                continue
            j = step.positions[start:end] - int(self.slots.seed_pos[req.slot]) - 1  # the row fed at each position
            hit = (j >= 0) & (j < len(req.rows))
            tok = torch.nonzero(hit).flatten()
            if tok.numel() == 0:
                continue
            self.stats["bridge_recomputed_rows"] += int(tok.numel())
            rows = torch.stack(req.rows).to(embeds.device).long()[j[tok].to(embeds.device)]
            embeds = embeds.index_copy(
                0, tok.to(embeds.device) + start, self.multimodal_embedding(rows).to(embeds.dtype)
            )
        return embeds

    # ------------------------------------------------------------------ logits and sampling

    def compute_logits(self, hidden_states: Tensor, sampling_metadata: Any = None) -> Tensor | None:
        """hidden [B, H] -> text logits [B, V]; audio-mode rows keep only their forced token."""
        if self._bridge_req_ids is not None and self._step is None:
            self._begin_replayed_bridge_step(hidden_states.shape[0])
        step = self._step
        if step is None or self.specials is None or hidden_states.shape[0] != step.num_reqs:
            self._pending = None
            return self.logits_processor(self.lm_head, hidden_states)
        sp = self.specials
        modes = S.row_modes(step, self.slots, sp.audio, sp.eos)
        self._pending = (hidden_states, modes)
        if self.slots.all_forced(step.req_ids):  # pure audio step: the text head is not computed
            self.stats["text_head_skipped"] += 1
            return S.forced_only_logits(modes, self.cfg.text.vocab_size, hidden_states.dtype)
        self.stats["text_head_full"] += 1
        return S.force_text_logits(self.logits_processor(self.lm_head, hidden_states), modes)

    def _begin_replayed_bridge_step(self, num_rows: int) -> None:
        """The bridge armed a step but our forward did not run: vLLM replayed a FULL decode graph (one token per
        request, in batch order), whose captured copies refreshed the token buffers."""
        req_ids, self._bridge_req_ids = self._bridge_req_ids, None
        if num_rows != len(req_ids):
            return
        self.stats["bridge_replayed_steps"] += 1
        qsl = torch.arange(num_rows + 1, device=self._tok_ids.device)
        self._begin_step(req_ids, self._tok_ids[:num_rows], self._tok_pos[:num_rows], qsl)

    def sample(self, logits: Tensor, sampling_metadata: Any):
        """The vllm-omni model sampler: forced text tokens and this step's codes (None: use vLLM's sampler)."""
        if self._pending is None or self._step is None:
            return None
        step = self._step
        for i, gen in (getattr(sampling_metadata, "generators", None) or {}).items():
            if i in step.new_rows:
                self.slots.set_seed(step.req_ids[i], resolve_seed(gen.initial_seed()))
        m = sampling_metadata
        params = row_params(step.num_reqs, logits.device, m.temperature, m.top_k, m.top_p)
        modes = self._pending[1]
        forced_only = self.slots.all_forced(step.req_ids) or bool(modes.audio.all())
        self.sample_codes(*params)
        if forced_only and sampling_metadata.max_num_logprobs is None:
            return compat.sampler_output(modes.forced)
        if self._text_sampler is None:
            self._text_sampler = compat.text_sampler(self.vllm_config)
        return self._text_sampler(logits, sampling_metadata)

    def sample_codes(self, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> list[Tensor | None]:
        """Sample this step's frames for the stashed rows; returns per request an owned [1, C] row or None."""
        if self._pending is None or self._step is None:
            return []
        hidden, modes = self._pending
        step, self._pending = self._step, None
        self.stats["sample_steps"] += 1
        emitted, new = S.sample_step(hidden, step, modes, self.slots, self.modality_head, (temperature, top_k, top_p))
        host = torch.cat([emitted, modes.code_rows[:, None], new.has_codes[:, None], new.done[:, None]], dim=1)
        self._published = self.slots.record(step.req_ids, host.to("cpu", torch.int32))  # the step's one sync
        self._cursor = 0
        self._step = None  # consumed: a dummy run before the next step's metadata sees no step
        return self._published

    # ------------------------------------------------------------------ publishing codes.audio

    def postprocess(self, hidden_states: Tensor, multimodal_outputs: Any = None, **_: Any) -> dict:
        """vllm-omni: called once per request in batch order after sampling; this step's owned row."""
        i, self._cursor = self._cursor, self._cursor + 1
        row = self._published[i] if i < len(self._published) else None
        return {"codes": {"audio": row}} if row is not None else {}

    def post_sample_multimodal_outputs(self, *, req_ids, invalid_req_indices=(), multimodal_outputs=None, **_):
        """This step's owned [1, C] rows by request (empty [0, C] where none)."""
        invalid = set(invalid_req_indices or ())
        empty = torch.zeros(0, self.cfg.num_codebooks, dtype=torch.int32)
        published = self._published
        rows = [published[i] if i < len(published) and published[i] is not None and i not in invalid else empty
                for i in range(len(req_ids))]  # fmt: skip
        return {"codes": {"audio": rows}}

    def make_omni_output(self, model_outputs: Any, **kwargs: Any):
        """Wrap the hidden states with the per-request ``codes.audio`` the runner buffered."""
        from vllm_omni.model_executor.models.output_templates import OmniOutput

        if isinstance(model_outputs, OmniOutput):
            return model_outputs
        infos = kwargs.get("model_intermediate_buffer") or kwargs.get("runtime_additional_information") or []
        empty = torch.zeros(0, self.cfg.num_codebooks, dtype=torch.int32)
        rows = []
        for info in infos:
            codes = (info.get("codes") or {}).get("audio") if isinstance(info, dict) else None
            rows.append(codes if isinstance(codes, Tensor) and codes.numel() else empty)
        mm = {"codes": {"audio": rows}} if any(r.numel() for r in rows) else None
        return compat.omni_output(model_outputs, mm)

    def request_rows(self, req_id: str) -> Tensor | None:
        """Every delayed row [R, C] int32 a request produced so far, live or recently finished (text-only
        bridge path keeps the last 256 finished requests); None for an unknown id."""
        req = self.slots.requests.get(req_id)
        if req is None and req_id in self.slots.finished:
            req = self.slots.finished[req_id][0]
        return self.slots.rows_of(req) if req is not None else None

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Checkpoint-named tensors -> parameters through vLLM's weight loaders (packed q/k/v and gate/up, tensor
        parallel shards); the names and checks are ``checkpoint.WeightRouter``'s. Returns the names loaded."""
        router = WeightRouter(dict(self.named_parameters()), self.cfg)
        for key, tensor in weights:
            hit = router.route(key, tensor)
            if hit is None:
                continue
            target, param = hit
            loader = getattr(param, "weight_loader", default_weight_loader)
            if target.shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, _QKV_SHARDS[target.shard] if ".qkv_proj." in target.param else target.shard)
        loaded = router.finish()
        self.specials = _resolve_specials(self.vllm_config, self.cfg)
        self.local_mlp.capture(self.cfg.text.hidden_size, self.multimodal_embedding.weight)
        self.loaded_weight_names = frozenset(loaded)
        return loaded


# ---------------------------------------------------------------------------------------------------------


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _resolve_specials(vllm_config: VllmConfig, cfg: TalkerConfig) -> SpecialTokens:
    from ..prompt import TalkerTokenizer

    mc = vllm_config.model_config
    path = getattr(mc, "tokenizer", None) or mc.model
    if not Path(str(path)).exists():
        path = mc.model
    return TalkerTokenizer.from_pretrained(path, cfg).specials


def _reference_rows(info: dict, num_codebooks: int) -> tuple[Tensor | None, Tensor | None]:
    """(delayed reference rows [R, C] int64, sorted placeholder positions [R] int64) from a request's info."""
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
        logger.debug("reference rows (%d) and placeholder positions (%d) differ; skipped", codes.shape[0],
                     where.numel())  # fmt: skip
        return None, None
    where, order = where.sort()
    return codes[order.to(codes.device)], where

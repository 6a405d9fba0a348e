"""The model class vLLM / vllm-omni build for Higgs-Audio V3 Stage 0: vLLM's Qwen3 backbone, the core's audio.

vLLM owns attention, KV cache, batching and its graphs; ``heads/`` everything audio (embedding and head, slots,
``SpanStep``, ``StepBuffers``), ``checkpoint.WeightRouter`` the weight names. The class implements vllm-omni's
Stage-0 runner contract (SPEC 6), in its order: ``update_decode_step_metadata``, ``forward``, ``make_omni_output``,
``compute_logits``, ``sample``, ``on_requests_finished``, weights; under plain vLLM ``bridge.TextOnlyBridge`` plays
the runner, finding this instance with ``talker_for``.

``sample`` leaves the step's codes on the device and takes no host sync, so with vLLM's async scheduling the
host prepares the next step while this one runs. The next step's ``make_omni_output``, called once its forward is
queued, waits for this step's rows and hands each request's new rows on as ``codes.audio`` (one step later, as
vllm-omni's own talker publishes them: a stream's last row goes out on its EOS step).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.model_executor.models.utils import maybe_prefix

from ..checkpoint import WeightRouter, engine_config
from ..config import SpecialTokens
from ..cuda_graphs.frame import FrameGraphs
from ..cuda_graphs.local_mlp import LocalMLPPath
from ..cuda_graphs.policy import decide
from ..heads.codebooks import build_codebooks
from ..heads.slots import RequestSlots, SlotStore
from ..heads.spans import SpanStep, StepBuffers, frame_results, rows_or_empty
from ..prompt import TalkerTokenizer
from ..row_linear_op import use_measured_rows_linear
from . import compat

logger = logging.getLogger(__name__)

_QKV_SHARDS = ("q", "k", "v")
_TALKERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # vllm_config.instance_id -> its adapter


def talker_for(vllm_config: Any) -> HiggsTalkerForConditionalGeneration | None:
    """The adapter vLLM built with this config (the bridge's handle on its model), or None."""
    return _TALKERS.get(getattr(vllm_config, "instance_id", None) or "")


class HiggsTalkerForConditionalGeneration(nn.Module):
    """Higgs-Audio V3 talker for vLLM: ``__init__(*, vllm_config, prefix="")``."""

    # vllm-omni runner contract (SPEC 6.1)
    prefer_model_sampler = True
    have_multimodal_outputs = True
    has_postprocess = False  # the rows go out through make_omni_output, from our own records
    skips_model_sampler_output_token_history = True
    supports_omni_query_start_loc = True
    supports_omni_decode_step_metadata = True
    requires_full_prefix_cached_hidden_states = False
    omni_pooler_payload_include_hidden = False
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        compat.check_supported()
        mc = vllm_config.model_config  # config.json as the direct engine reads it, not vllm-omni's class's defaults
        path = getattr(mc, "hf_config_path", None) or mc.model
        self.cfg = cfg = engine_config(path, getattr(mc, "hf_overrides", None), mc.hf_config)
        t, self.vllm_config = cfg.text, vllm_config
        backbone = compat.backbone_config(vllm_config, t.to_qwen3_config())
        self.model = Qwen3Model(vllm_config=backbone, prefix=maybe_prefix(prefix, "model"))
        if t.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(t.vocab_size, t.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(t.vocab_size)
        # replicated on every tensor-parallel rank: the hidden rows they read are replicated too
        self.multimodal_embedding, self.modality_head = build_codebooks(cfg)
        device = self.multimodal_embedding.weight.device
        max_seqs = compat.max_num_seqs(vllm_config)
        self.slots = RequestSlots(SlotStore.for_config(cfg, max(64, max_seqs), device), seed=getattr(mc, "seed", None))
        # sized for vLLM's largest batch and graph: a FULL decode graph captured over our forward holds them
        self.buffers = StepBuffers(max([max_seqs, *compat.capture_sizes(vllm_config)]) + 1, cfg.num_codebooks, device)
        self.specials: SpecialTokens | None = None
        self.loaded_weight_names: frozenset[str] = frozenset()
        # what the steps did (tests and logs read these)
        self.stats = dict.fromkeys(("text_head_skipped", "text_head_full", "sample_steps", "bridge_replayed_steps",
                                    "bridge_no_qsl", "bridge_recomputed_rows"), 0)  # fmt: skip
        self.deferred_prefix_cache_mm_keys = {"codes.audio"}
        self._runner_req_ids: list[str] | None = None  # from prepare_runner_inputs, for the step's metadata
        self._batch: list[str] = []  # the requests of the runner's current step, in batch order
        # the current step (None: a dummy or profile run); one the bridge armed is laid out in the forward
        self.step: SpanStep | None = None
        self._text_sampler = None
        self.graph_decision = decide(vllm_config=vllm_config)
        logger.info("higgs talker (vLLM adapter): %s", self.graph_decision.reason)
        layers = self.model.layers[self.model.start_layer : self.model.end_layer]  # this pipeline stage's
        self.local_mlp = LocalMLPPath(layers, self.model.norm, self.graph_decision.local_mlp, max_seqs,
                                      forward_context=compat.forward_context)  # fmt: skip
        self.frame_graphs: FrameGraphs | None = None  # captured by load_weights where asked for (cuda_graphs.frame)
        _TALKERS[getattr(vllm_config, "instance_id", "") or ""] = self

    def prepare_runner_inputs(self, *, input_ids: Tensor, positions: Tensor, req_ids=None, **_: Any):
        """vllm-omni's AR runner (0.26, 0.30) names the step's requests here, before its forward; inputs unchanged."""
        self._runner_req_ids = None if req_ids is None else list(req_ids)
        return input_ids, positions

    def update_decode_step_metadata(
        self, *, input_ids=None, positions=None, omni_query_start_loc=None, req_ids=None, **_: Any
    ) -> None:
        """Called by the vllm-omni runner before every forward or graph replay (0.26 passes no ``req_ids``: the
        ones ``prepare_runner_inputs`` got for this step stand in; a dummy run has neither)."""
        req_ids, self._runner_req_ids = (req_ids if req_ids is not None else self._runner_req_ids), None
        self.step, self._batch = None, list(req_ids or ())
        if req_ids is None or input_ids is None or positions is None or omni_query_start_loc is None:
            self.buffers.clear()
            return
        qsl, step = omni_query_start_loc, SpanStep(list(req_ids))
        self.step = self.buffers.lay_out(step, self.slots, input_ids, positions, qsl)

    def set_bridge_requests(self, req_ids, seeds, min_rows=None, references=None, resume=None) -> None:
        """The text-only bridge's batch, before a real step. Its feedback is written for a pure decode step (token i =
        request i), which a replayed FULL decode graph reads; an eager forward rewrites it for the real layout."""
        self.step = step = SpanStep(list(req_ids), references)
        slots, _ = self.slots.sync(step.req_ids, seeds, min_rows, resume)
        self.buffers.write_decode_feedback(self.slots, step.req_ids, slots)

    def on_requests_finished(self, finished_req_ids) -> None:
        self.slots.release(finished_req_ids)

    def on_requests_removed(self, req_ids) -> None:
        """The bridge's requests that left vLLM's batch, finished or preempted (vLLM does not say): kept to resume."""
        self.slots.release(req_ids, keep=True)

    def embed_input_ids(self, input_ids: Tensor, **_: Any) -> Tensor:
        """Text embedding (placeholder ids < 0 embed as 0 and are replaced later)."""
        return self.model.embed_input_ids(input_ids.clamp(min=0))

    def forward(self, input_ids, positions: Tensor, intermediate_tensors=None, inputs_embeds=None, **kwargs: Any):
        """Scheduled tokens [T] -> final hidden [T, H]."""
        if input_ids is not None:  # the bridge's replayed decode steps read these copies
            self.buffers.keep_tokens(input_ids, positions)
        if self.step is not None and not self.step.laid_out and input_ids is not None:
            qsl = compat.step_query_start_loc(self.step.num_reqs, positions)
            if qsl is None:
                self.stats["bridge_no_qsl"] += 1
                compat.warn_once("no-qsl", "the step's request spans are unknown (no attention metadata): no codes")
                self.step = None
                self.buffers.clear()  # no feedback this step rather than feedback on the wrong tokens
            else:
                self.step = self.buffers.lay_out(self.step, self.slots, input_ids, positions, qsl)
        embeds = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        step = self.step if self.step is not None and self.step.laid_out else None
        infos = compat.runner_infos(kwargs)
        embeds, refed = self.buffers.embed_codes(embeds, self.multimodal_embedding, self.slots, step, infos)
        self.stats["bridge_recomputed_rows"] += refed
        pure_decode = step is not None and embeds.shape[0] == step.num_reqs
        hidden = self.local_mlp.forward(positions, embeds, pure_decode)  # None: not a step its graphs take
        return hidden if hidden is not None else self.model(None, positions, intermediate_tensors, inputs_embeds=embeds)

    def compute_logits(self, hidden_states: Tensor, sampling_metadata: Any = None) -> Tensor | None:
        """hidden [B, H] -> text logits [B, V]; audio-mode rows keep only their forced token."""
        step = self.step
        if step is not None and not step.laid_out and hidden_states.shape[0] == step.num_reqs:
            # the bridge armed a step but our forward did not run: vLLM replayed a FULL decode graph (one token per
            # request, in batch order), whose captured copies refreshed the token buffers
            self.stats["bridge_replayed_steps"] += 1
            self.step = self.buffers.lay_out(step, self.slots, *self.buffers.decode_layout(step.num_reqs))
        if step is None or not step.laid_out or self.specials is None or hidden_states.shape[0] != step.num_reqs:
            self.step = None  # left to vLLM's sampler (sample() says None); no later forward may use it
            return self.logits_processor(self.lm_head, hidden_states)
        head = functools.partial(self.logits_processor, self.lm_head)
        logits, skipped = step.text_logits(self.slots, hidden_states, self.specials, head, self.cfg.text.vocab_size)
        self.stats["text_head_skipped" if skipped else "text_head_full"] += 1
        return logits

    def sample(self, logits: Tensor, sampling_metadata: Any):
        """The vllm-omni model sampler: forced text tokens and this step's codes (None: use vLLM's sampler)."""
        step, m = self.step, sampling_metadata
        if step is None or step.forced is None:
            return None
        generators = getattr(m, "generators", None) or {}
        step.adopt_seeds(self.slots, {i: gen.initial_seed() for i, gen in generators.items()})
        forced_only = step.all_forced or bool(step.modes.audio.all())  # before the frame work is queued (a sync)
        self.sample_codes(m.temperature, m.top_k, m.top_p)
        if forced_only and m.max_num_logprobs is None:
            return compat.sampler_output(step.forced)
        return self._text_sampler(logits, m)

    def sample_codes(self, temperature: Tensor | None, top_k: Tensor | None, top_p: Tensor | None) -> None:
        """Sample the armed step's frames (recorded at ``slots.settle``); parameters as vLLM's metadata has them."""
        step = self.step
        if step is None or step.forced is None:
            return
        self.stats["sample_steps"] += 1
        self.step = None  # consumed: a dummy run before the next step's metadata sees none
        step.sample(self.slots, self.modality_head, self.frame, (temperature, top_k, top_p), self.frame_graphs)

    def post_sample_multimodal_outputs(self, *, req_ids, invalid_req_indices=(), multimodal_outputs=None, **_):
        """For a runner that asks right after sampling (newer vllm-omni): the rows each request produced since they
        were last handed on (waiting for this step's), [R, C] int32 (empty [0, C] where none or invalid)."""
        invalid = set(invalid_req_indices or ())
        rows = self.slots.ship([None if i in invalid else rid for i, rid in enumerate(req_ids)])
        return {"codes": {"audio": rows_or_empty(rows, self.cfg.num_codebooks)}}

    def make_omni_output(self, model_outputs: Any, **_: Any):
        """After the step's forward is queued: the hidden states with, per request of the step, the rows it produced
        since they were last handed on (the step before's, waited for now), [R, C] int32 in ``codes.audio``."""
        from vllm_omni.model_executor.models.output_templates import OmniOutput

        if isinstance(model_outputs, OmniOutput):
            return model_outputs
        batch, self._batch = self._batch, []  # once per step's metadata: a dummy run after it hands nothing on
        rows = rows_or_empty(self.slots.ship(batch), self.cfg.num_codebooks)
        mm = {"codes": {"audio": rows}} if any(r.numel() for r in rows) else None
        return OmniOutput(text_hidden_states=model_outputs, multimodal_outputs=mm)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Checkpoint-named tensors -> parameters through vLLM's weight loaders (packed q/k/v and gate/up, tensor
        parallel shards); the names and checks are ``checkpoint.WeightRouter``'s. Returns the names loaded."""
        router = WeightRouter(dict(self.named_parameters()), self.cfg)
        for target, param, tensor in router.routed(weights):
            loader = getattr(param, "weight_loader", default_weight_loader)
            if target.shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, _QKV_SHARDS[target.shard] if ".qkv_proj." in target.param else target.shard)
        loaded = router.finish()
        mc = self.vllm_config.model_config
        path = getattr(mc, "tokenizer", None) or mc.model
        path = path if Path(str(path)).exists() else mc.model
        self.specials = sp = TalkerTokenizer.from_pretrained(path, self.cfg).specials
        self.frame = functools.partial(frame_results, audio_id=sp.audio, eos_id=sp.eos)
        vocab, device = self.cfg.text.vocab_size, self.multimodal_embedding.weight.device
        self._text_sampler = compat.text_sampler(self.vllm_config, vocab, device)  # warmed up: no compile in serving
        if (said := use_measured_rows_linear(self.local_mlp.layers, mc.hf_config)) is not None:  # before its graphs
            logger.info("higgs talker (vLLM adapter): %s", said)
        self.local_mlp.capture(self.cfg.text.hidden_size, self.multimodal_embedding.weight)
        if self.frame_graphs is None:
            args = (self.frame, self.slots, self.modality_head, compat.max_num_seqs(self.vllm_config), sp.audio)
            self.frame_graphs = FrameGraphs.if_asked(mc.hf_config, *args)
        self.loaded_weight_names = frozenset(loaded)
        return loaded

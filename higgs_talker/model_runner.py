"""The device side of one step: KV cache, attention backend, decode-state slots, model and heads.

``run(batch)`` executes a ``StepBatch`` eagerly and returns the step's rows ``[B, C + 1]`` int64 on the device:
the frame each request just produced and its done flag (the terminal row). ``forward(inputs)`` is the
graph-safe part on device tensors only (no host sync, no data-dependent shapes); ``cuda_graphs`` captures and
replays exactly this function, so a decode step lives in one place.

A decode step feeds each request its previous frame: the token embedding is the fused codebook embedding of
the slot's last codes, or the text embedding of ``<|audio|>`` before the first frame (SPEC 4.8).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .attention import AttentionBackend, SdpaAttention, use_backend
from .batch import DeviceBatch, StepBatch
from .config import SpecialTokens, TalkerConfig
from .flashinfer_attention import check_decode_kernel
from .heads.codebooks import embed_rows, feed_back
from .heads.slots import SlotStore, sample_frame
from .kv_cache import allocate_kv_caches
from .model import PostAttention, TalkerModel, post_attention_block
from .ops import FLASHINFER_HEAD_DIMS

logger = logging.getLogger(__name__)


def default_backend(
    kv_caches: list[Tensor], cfg: TalkerConfig, max_model_len: int, scratch_block: int, max_batch: int, kernel: str
) -> AttentionBackend:
    """FlashInfer on CUDA when it is installed and serves the head size (``ops.FLASHINFER_HEAD_DIMS``), else torch
    SDPA (CPU, CUDA without FlashInfer, or another head size)."""
    t = cfg.text
    args = (kv_caches, t.num_attention_heads, t.num_key_value_heads, t.head_dim, max_model_len, scratch_block)
    if kv_caches[0].device.type == "cuda" and t.head_dim in FLASHINFER_HEAD_DIMS:
        try:
            from .flashinfer_attention import FlashInferAttention

            return FlashInferAttention(*args, decode_kernel=kernel, max_batch=max_batch)
        except ImportError:
            logger.warning(
                "FlashInfer is not installed: CUDA attention runs on torch SDPA, which is slower "
                "(pip install -e '.[gpu]' in the higgs_talker checkout)"
            )
    return SdpaAttention(*args)


class ModelRunner:
    def __init__(
        self,
        model: TalkerModel,
        cfg: TalkerConfig,
        specials: SpecialTokens,
        *,
        max_num_seqs: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        attention: AttentionBackend | None = None,
        decode_kernel: str = "auto",
    ) -> None:
        check_decode_kernel(decode_kernel)
        self.model, self.cfg, self.specials = model, cfg, specials
        self.max_num_seqs = max_num_seqs
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size, self.max_model_len = block_size, max_model_len
        # two extra blocks that no request owns (batch.py's padding rules): padding requests of decode buckets
        # write and read the scratch block; padding tokens of prefill buckets read it and write the dump block
        self.scratch_block, self.dump_block = num_blocks, num_blocks + 1
        self.kv_caches = allocate_kv_caches(cfg.text, num_blocks + 2, block_size, self.dtype, self.device)
        self.slots = SlotStore.for_config(cfg, max_num_seqs, self.device)
        self.attn = attention or default_backend(
            self.kv_caches, cfg, max_model_len, self.scratch_block, max_num_seqs, decode_kernel
        )

    def padded(self, batch: StepBatch, size: int) -> StepBatch:
        """A decode batch padded to ``size`` requests on the scratch slot and scratch block."""
        return batch.padded(size, self.slots.scratch, self.scratch_block, self.block_size)

    def padding_batch(self, size: int) -> StepBatch:
        """A decode batch of ``size`` padding requests only (graph capture and warm-up)."""
        return self.padded(StepBatch([], [], [], [], [], []), size)

    def prefill_requests(self, tokens: int) -> int:
        """The request count of a prefill batch padded to ``tokens`` tokens: as many real ones as it could hold,
        plus the padding request."""
        return min(tokens, self.max_num_seqs) + 1

    def padded_prefill(self, batch: StepBatch, tokens: int) -> StepBatch:
        """A prefill batch padded to ``tokens`` tokens and ``prefill_requests(tokens)`` requests."""
        return batch.padded_prefill(
            tokens, self.prefill_requests(tokens), self.slots.scratch, self.scratch_block, self.dump_block,
            self.block_size,
        )  # fmt: skip

    def prefill_padding_batch(self, tokens: int) -> StepBatch:
        """A prefill batch of ``tokens`` padding tokens only (graph capture: it touches no request's state)."""
        return self.padded_prefill(StepBatch([], [], [], [], [], [], token_ids=[]), tokens)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> Tensor:
        """Execute ``batch`` eagerly -> rows [B, C + 1] int64 (device)."""
        self.slots.reset(batch.new_slots)
        self.attn.plan(batch)
        return self.forward(batch.to_device(self.device))

    def forward(self, inputs: DeviceBatch, post_attention: PostAttention | None = None) -> Tensor:
        """Embed -> model -> codebook head -> ``sample_frame``: rows [B, C + 1] int64 (codes, done flag).

        Graph-safe for decode inputs once the attention backend is planned. ``post_attention`` is the local MLP
        graph hook (decode only).
        """
        model = self.model
        with use_backend(self.attn):
            if inputs.is_decode:
                hidden = model(self._feedback(inputs.slots), inputs.positions, post_attention)  # [B, H]
            else:
                embeds = self.embed_prompt(inputs) if inputs.embeds is None else inputs.embeds
                hidden = model(embeds, inputs.positions)[inputs.last_token]  # [B, H]
        logits = model.modality_head(hidden).float()  # [B, C, V]
        emitted, new = sample_frame(self.slots, inputs.slots, logits, draw=inputs.draw, filter=inputs.filter)
        return torch.cat([emitted, new.done[:, None].long()], dim=1)

    def embed_prompt(self, inputs: DeviceBatch) -> Tensor:
        """A prefill's token embeddings [N, H]: text ids, with the audio positions embedded from their codes."""
        model = self.model
        embeds = model.embed_text(inputs.token_ids)
        return embed_rows(embeds, inputs.audio_index, inputs.audio_codes, model.multimodal_embedding)

    def eager_post_attention(self, layer: int, hidden: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s post-attention block, eagerly (what local MLP graphs capture)."""
        return post_attention_block(self.model.model.layers[layer], hidden, residual)

    def _feedback(self, slots: Tensor) -> Tensor:
        """Decode embeddings [B, H]: each request's last frame, or ``<|audio|>`` before its first (SPEC 4.8)."""
        model, state = self.model, self.slots.state
        audio = torch.full(slots.shape, self.specials.audio, dtype=torch.long, device=slots.device)
        use, last = state.has_codes.index_select(0, slots), state.last_codes.index_select(0, slots)
        return feed_back(model.embed_text(audio), use, last, model.multimodal_embedding)

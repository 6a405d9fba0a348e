"""FlashInfer attention over the paged KV cache (CUDA): the ``attention.AttentionBackend`` protocol.

Prefill runs FlashInfer's batched paged prefill. Decode runs one of FlashInfer's kernels, chosen per graph
bucket by measurement (``cuda_graphs.kernels``):

- ``native``: its paged decode kernel (CUDA cores);
- ``native_tc``: the same wrapper with ``use_tensor_cores=True``: the FA2 prefill kernels with each KV head's
  query heads packed into one tile, which suits GQA. In CUDA-graph mode FlashInfer always splits the KV into
  chunks and merges the partial results in a second kernel;
- ``native_tc_nosplit``: ``native_tc`` planned with ``disable_split_kv``: one CTA per (request, KV head) over the
  whole context and no merge kernel (fewer launches for short contexts and large batches; slower for long
  contexts at small batch, where the split spreads the work); pinned only (``AUTO_KERNELS``);
- ``fa3``: tensor-core decode on FlashInfer's FA3 (Hopper, sm_90) kernels;
- ``xqa``: ``trtllm_batch_decode_with_kv_cache(backend="xqa")``. XQA gets its own zeroed workspace: sharing the
  native wrapper's made it return wrong outputs wherever it splits sequences (GPU.md);
- ``triton``: ours (``triton_attention.paged_decode``): split over the context and merged in one launch, with no
  host-side plan (block tables and lengths as device tensors, as XQA reads them).

``decode_kernel="auto"`` measures ``AUTO_KERNELS``; any kernel can be pinned.

Planning happens on the host in ``plan`` / ``plan_bucket`` / ``plan_prefill_bucket``; ``forward`` only
launches kernels. Every decode bucket reads slices ``[:size]`` of one set of fixed device buffers sized for the
largest batch (allocated here, refreshed by each bucket's ``plan_bucket``), so a captured decode step replays
with whatever the last ``plan_bucket`` of its bucket wrote. A prefill token bucket has its own prefill wrapper
in FlashInfer's CUDA-graph mode (fixed request count, at most the bucket's tokens) and its own buffers.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from torch import Tensor

from .attention import block_table_array

if TYPE_CHECKING:
    from .batch import StepBatch

W = TypeVar("W")
WORKSPACE_BYTES = 256 * 1024 * 1024
KERNELS = ("native", "xqa", "native_tc", "native_tc_nosplit", "fa3", "triton")

# The kernels that run through FlashInfer's decode wrapper: (wrapper options, plan options) of each.
WRAPPER_KERNELS: dict[str, tuple[dict, dict]] = {
    "native": ({"use_tensor_cores": False}, {}),
    "native_tc": ({"use_tensor_cores": True}, {}),
    "native_tc_nosplit": ({"use_tensor_cores": True}, {"disable_split_kv": True}),
    "fa3": ({"use_tensor_cores": True, "backend": "fa3"}, {}),
}


def check_decode_kernel(kernel: str) -> None:
    """Refuse a ``decode_kernel`` option that names no kernel (on every device: CPU ignores the option)."""
    if kernel not in ("auto", *KERNELS):
        raise ValueError(f"decode_kernel must be 'auto' or one of {', '.join(KERNELS)}, got {kernel!r}")


# What ``auto`` measures per bucket. In whole decode steps on the H200 (4B shape, batches 1 / 16 / 64, contexts 512
# and 2048; benchmarks/results/h200_20261202b/decode_kernels_20261202-042715.json) ``native_tc`` was fastest at
# five points and ``native_tc_nosplit`` at batch 16, context 512 (by 2.6 %); ``native`` lost at all six, ``fa3``
# tied at batch 1, context 512 and lost by 20% to 3x elsewhere. XQA lost at all six too, but it is the fastest
# kernel alone at long contexts, so it stays a candidate for other shapes and GPUs. ``native_tc_nosplit`` is no
# longer measured: its CUDA-graph plans leave padded CTAs unmasked, which made H100 starts sit for minutes in the
# check of their cached choices (results/h100_20261206); ``_graph_wrapper`` now zeroes what they read (confirmed on
# an H100, results/h100_20261206b), and it was not measured again. ``triton`` (ours: one launch where FlashInfer's
# split decode takes two, with the QK-norm/RoPE/K-V write inside it) was the fastest in whole steps at all eight
# points of an H100 run (batches 1/4/16/64 x contexts 512/2048: 3.44 vs 3.63 ms at 1 x 512, 5.64 vs 6.22 at 64 x 512,
# 10.26 vs 10.80 at 64 x 2048 against native_tc; results/h100_20261206e); auto measures it beside the others. Every
# kernel can be pinned.
AUTO_KERNELS = ("native_tc", "xqa", "triton")
TABLE_KERNELS = ("xqa", "triton")  # the kernels that read block tables and lengths (device buffers), no wrapper
# Where a decode step's kernel is ``triton``, the model's fused QK-norm + RoPE + K/V write runs inside its launch
# (``attend_qkv``: one launch a layer fewer); False keeps the separate kernel before it in backends made after
# (benchmarks' A/B).
TRITON_TAKES_QKV = True


Attend = Callable[[Tensor, Tensor], Tensor]  # (q [N, Hq, D], layer cache) -> [N, Hq, D]
# (layer, qkv [N, (Hq + 2 Hk) D], positions, q_weight, k_weight, eps, cos_sin) -> [N, Hq * D]
AttendQkv = Callable[[int, Tensor, Tensor, Tensor, Tensor, float, Tensor], Tensor]


def _graph_wrapper(wrapper: W) -> W:
    """``wrapper``, a new FlashInfer wrapper in CUDA-graph mode, with its pinned plan buffer zeroed (before any plan).

    In that mode a wrapper launches a fixed, padded number of CTAs, and a plan writes the tile tables (request,
    query tile, KV tile) of the real ones only, then copies the whole pinned buffer to the device. Where the KV
    is split a mask stops the padded CTAs; without the split (``disable_split_kv``, and prefill plans that do not
    split) nothing does, and they run on whatever the buffer held before: ``torch.empty(pin_memory=True)``
    gets a freed pinned block back with its old bytes. Read as tile indices those can send a CTA out of its
    request or into a loop of billions of tokens: H100 starts stuck for minutes, and with a buffer of 0x01 bytes an
    illegal memory access (``test_gpu``'s stale-buffer test without this, ``results/h100_20261206b``). Zeroed, a
    padded entry names request 0's first tile, which the CTA recomputes and writes as its own CTA does. A bucket's
    plans never write its padded entries (the request count is fixed), so they stay zero."""
    staging = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)  # FlashInfer's name for that buffer
    if isinstance(staging, torch.Tensor):
        staging.zero_()
    return wrapper


class FlashInferAttention:
    """CUDA backend. ``scratch_block`` is a KV block no request owns (padding rows write there); ``max_batch``
    sizes the decode buffers that graph buckets share."""

    supports_prefill_graphs = True

    def __init__(
        self,
        kv_caches: list[Tensor],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_model_len: int,
        scratch_block: int = 0,
        decode_kernel: str = "auto",
        max_batch: int = 64,
    ) -> None:
        import flashinfer

        check_decode_kernel(decode_kernel)
        self.fi = flashinfer
        self.kv_caches = kv_caches
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = kv_caches[0].shape[2]
        self.max_blocks = -(-max_model_len // self.block_size)
        self.max_model_len, self.scratch_block = max_model_len, scratch_block
        self.decode_kernel, self.max_batch = decode_kernel, max_batch
        self.scale = head_dim**-0.5
        self.dtype = kv_caches[0].dtype
        dev = self.device = kv_caches[0].device
        self.decode_kernels = AUTO_KERNELS if decode_kernel == "auto" else (decode_kernel,)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.xqa_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)  # never shared
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # eager decode steps: the pinned kernel's wrapper (XQA needs none), the plain decode kernel under auto
        eager_kernel = decode_kernel if decode_kernel in WRAPPER_KERNELS else "native"
        wrapper_options, self._eager_plan_options = WRAPPER_KERNELS[eager_kernel]
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", **wrapper_options)
        # fixed decode buffers for graph buckets (each bucket reads [:size])
        self.kv_index = torch.zeros(2, max_batch, dtype=torch.long, device=dev)
        self.indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(max_batch * self.max_blocks, dtype=torch.int32, device=dev)
        self.last_page = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((max_batch, self.max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.bucket_kernel: dict[int, str] = {}
        self._graph_wrappers: dict[tuple[int, str], object] = {}  # (bucket, wrapper kernel) -> wrapper
        self._plan_copied: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> after its last plan's copies
        self._prefill_buckets: dict[tuple[int, int], tuple[object, Tensor]] = {}  # (tokens, reqs) -> wrapper, rows
        self._kv: Tensor | None = None  # [2, N] flat cache rows of this step's K and V
        self._attend: Attend | None = None
        self._attend_qkv: AttendQkv | None = None  # this step's attention from qkv rows, where its kernel takes them
        self.takes_qkv = TRITON_TAKES_QKV  # as the module said when this backend was made
        self._triton_scratch = None  # triton_attention.DecodeScratch, made at the triton kernel's first plan

    def fork(self, kv_caches: list[Tensor]) -> FlashInferAttention:
        """A backend with these settings over other caches (kernel measurement on synthetic data)."""
        n = kv_caches[0].shape[0]
        fork = FlashInferAttention(
            kv_caches, self.num_heads, self.num_kv_heads, self.head_dim, self.max_model_len, n - 1,
            self.decode_kernel, self.max_batch,
        )  # fmt: skip
        fork.takes_qkv = self.takes_qkv
        return fork

    def set_bucket_kernel(self, size: int, kernel: str) -> None:
        if kernel not in self.decode_kernels:
            raise ValueError(f"decode kernel {kernel!r} is not allowed here ({', '.join(self.decode_kernels)})")
        if size > self.max_batch:
            raise ValueError(f"bucket {size} exceeds the decode buffers' batch of {self.max_batch}")
        self.bucket_kernel[size] = kernel

    # ------------------------------------------------------------------ host side

    def _paged(self, tables: list[list[int]], seq_lens: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer's (indptr, indices, last_page_len) int32 of the used blocks."""
        if len(tables) != len(seq_lens):
            raise ValueError(f"{len(tables)} block tables for {len(seq_lens)} sequence lengths")
        lens = np.asarray(seq_lens, dtype=np.int32)
        used = -(-lens // self.block_size)
        indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        np.cumsum(used, out=indptr[1:])
        # each table's used head, chained in C (a per-block Python loop was ~0.2 ms a 64-row step: py-spy, H200)
        heads = map(operator.getitem, tables, map(slice, used.tolist()))
        indices = np.fromiter(itertools.chain.from_iterable(heads), dtype=np.int32, count=int(indptr[-1]))
        last = lens - np.maximum(used - 1, 0) * self.block_size  # 0: no context
        return indptr, indices, last

    def _plan_once_copied(self, wrapper, plan: Callable[[], None]) -> None:
        # A wrapper stages its plan in one pinned host buffer and copies it to the device on the stream. With a
        # step queued ahead (asynchronous scheduling) the previous plan's copy may still be waiting there.
        copied = self._plan_copied.get(id(wrapper))
        if copied is not None:
            copied.synchronize()
        plan()
        copied = self._plan_copied[id(wrapper)] = torch.cuda.Event()
        copied.record()

    def _paged_for_plan(self, tables: list[list[int]], seq_lens: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """``_paged`` as plan() takes it: indptr and last_page_len on the host (plan schedules from them), the
        page indices already on the device. FlashInfer's CUDA-graph wrappers copy host indices with a blocking
        copy (``non_blocking`` only when they are on the device), which would synchronize the stream and make
        the host wait for the step queued ahead; an asynchronous upload here does not."""
        indptr, indices, last = self._paged(tables, seq_lens)
        device_indices = torch.from_numpy(indices).to(self.device, non_blocking=True)
        return torch.from_numpy(indptr), device_indices, torch.from_numpy(last)

    def _plan_decode(self, wrapper, batch: StepBatch, options: dict) -> None:
        indptr, indices, last = self._paged_for_plan(batch.block_tables, batch.seq_lens)
        self._plan_once_copied(wrapper, lambda: wrapper.plan(
            indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size,
            pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
            **options,
        ))  # fmt: skip

    def _plan_prefill(self, wrapper, query_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> None:
        indptr, indices, last = self._paged_for_plan(tables, seq_lens)
        qo = torch.from_numpy(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32))
        self._plan_once_copied(wrapper, lambda: wrapper.plan(
            qo, indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size,
            causal=True, q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
        ))  # fmt: skip

    def _kv_rows(self, slots: list[int]) -> Tensor:
        """[2, N] int64 (host): the flat cache rows of each new token's K and V (cache viewed as [-1, Hk, D])."""
        bs = self.block_size
        s = np.asarray(slots, dtype=np.int64)
        k = (s // bs) * (2 * bs) + s % bs
        return torch.from_numpy(np.stack([k, k + bs]))

    def _xqa(self, tables: Tensor, lens: Tensor) -> Attend:
        def attend(q: Tensor, cache: Tensor) -> Tensor:
            return self.fi.decode.trtllm_batch_decode_with_kv_cache(
                q, cache, self.xqa_workspace, tables, lens, self.max_model_len,
                bmm1_scale=self.scale, bmm2_scale=1.0, kv_layout="NHD", backend="xqa",
            )  # fmt: skip

        return attend

    def _triton(self, tables: Tensor, lens: Tensor) -> Attend:
        from . import triton_attention

        if self._triton_scratch is None:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._triton_scratch = triton_attention.DecodeScratch(
                self.max_batch, self.num_heads, self.num_kv_heads, self.head_dim, sms, self.device
            )
        scratch, kv = self._triton_scratch, self._kv

        def attend(q: Tensor, cache: Tensor) -> Tensor:
            return triton_attention.paged_decode(q, cache, tables, lens, self.scale, scratch)

        def attend_qkv(layer: int, qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                       cos_sin: Tensor) -> Tensor:  # fmt: skip
            return triton_attention.paged_decode_qkv(
                qkv, positions, q_weight, k_weight, eps, cos_sin, kv, self.kv_caches[layer], tables, lens,
                self.scale, scratch,
            ).reshape(qkv.shape[0], -1)  # fmt: skip

        self._attend_qkv = attend_qkv if self.takes_qkv else None
        return attend

    def _table_kernel(self, kernel: str, tables: Tensor, lens: Tensor) -> Attend:
        return self._xqa(tables, lens) if kernel == "xqa" else self._triton(tables, lens)

    def plan(self, batch: StepBatch) -> None:
        """Eager step: plan prefill or decode for exactly this batch."""
        self._attend_qkv = None  # unless this step's kernel takes qkv rows (``_triton``)
        self._kv = self._kv_rows(batch.slot_mapping).to(self.device, non_blocking=True)
        if not batch.is_decode:
            self._plan_prefill(self.prefill, batch.query_lens, batch.seq_lens, batch.block_tables)
            self._attend = self.prefill.run
        elif self.decode_kernel in TABLE_KERNELS:
            tables = block_table_array(batch.block_tables, self.max_blocks, self.scratch_block)
            lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
            tables = torch.from_numpy(tables).to(self.device, non_blocking=True)
            self._attend = self._table_kernel(self.decode_kernel, tables, lens.to(self.device, non_blocking=True))
        else:
            self._plan_decode(self.decode, batch, self._eager_plan_options)
            self._attend = self.decode.run

    def plan_bucket(self, batch: StepBatch) -> None:
        """A decode batch padded to its bucket (``batch.num_reqs``) into the fixed buffers' first rows."""
        self._attend_qkv = None  # unless this step's kernel takes qkv rows (``_triton``)
        size = batch.num_reqs
        kernel = self.bucket_kernel.get(size, self.decode_kernels[0])
        self.kv_index[:, :size].copy_(self._kv_rows(batch.slot_mapping), non_blocking=True)
        self._kv = self.kv_index[:, :size]
        if kernel not in TABLE_KERNELS:
            wrapper_options, plan_options = WRAPPER_KERNELS[kernel]
            wrapper = self._graph_wrappers.get((size, kernel))
            if wrapper is None:
                wrapper = _graph_wrapper(self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True,
                    paged_kv_indptr_buffer=self.indptr[: size + 1],
                    paged_kv_indices_buffer=self.indices[: size * self.max_blocks],
                    paged_kv_last_page_len_buffer=self.last_page[:size], **wrapper_options,
                ))  # fmt: skip
                self._graph_wrappers[size, kernel] = wrapper
            self._plan_decode(wrapper, batch, plan_options)
            self._attend = wrapper.run
        else:
            tables = block_table_array(batch.block_tables, self.max_blocks, self.scratch_block)
            self.block_tables[:size].copy_(torch.from_numpy(tables), non_blocking=True)
            self.seq_lens[:size].copy_(torch.tensor(batch.seq_lens, dtype=torch.int32), non_blocking=True)
            self._attend = self._table_kernel(kernel, self.block_tables[:size], self.seq_lens[:size])

    def prefill_pages(self, tokens: int, reqs: int) -> int:
        """The KV pages a prefill token bucket's buffers hold: a context of up to ``max_model_len`` for each real
        request (a prefix-cache hit attends over cached blocks before its query), plus the padding request's."""
        return (reqs - 1) * self.max_blocks + -(-tokens // self.block_size)

    def plan_prefill_bucket(self, batch: StepBatch) -> None:
        """A prefill batch padded to a token bucket (``StepBatch.padded_prefill``) into that bucket's wrapper and
        buffers, which a captured prefill step reads at replay. Its contexts must fit ``prefill_pages``."""
        self._attend_qkv = None  # unless this step's kernel takes qkv rows (``_triton``)
        tokens, reqs = batch.num_tokens, batch.num_reqs
        entry = self._prefill_buckets.get((tokens, reqs))
        if entry is None:
            entry = self._prefill_buckets[tokens, reqs] = self._prefill_bucket(tokens, reqs)
        wrapper, rows = entry
        rows.copy_(self._kv_rows(batch.slot_mapping), non_blocking=True)
        self._kv = rows
        self._plan_prefill(wrapper, batch.query_lens, batch.seq_lens, batch.block_tables)
        self._attend = wrapper.run

    def _prefill_bucket(self, tokens: int, reqs: int) -> tuple[object, Tensor]:
        dev, pages = self.device, self.prefill_pages(tokens, reqs)
        wrapper = _graph_wrapper(self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(reqs + 1, dtype=torch.int32, device=dev),
            paged_kv_indptr_buf=torch.zeros(reqs + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buf=torch.zeros(pages, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buf=torch.zeros(reqs, dtype=torch.int32, device=dev),
        ))  # fmt: skip
        # The first plan fixes the most rows the wrapper's kernels are launched for: plan all ``tokens`` once
        # (as one padding request over the scratch block).
        tables = [[]] * (reqs - 1) + [[self.scratch_block] * -(-tokens // self.block_size)]
        lens = [0] * (reqs - 1) + [tokens]
        self._plan_prefill(wrapper, lens, lens, tables)
        return wrapper, torch.zeros(2, tokens, dtype=torch.long, device=dev)

    # ------------------------------------------------------------------ device side

    def kv_destination(self, layer: int) -> tuple[Tensor, Tensor]:
        """(the layer's cache as rows [R, Hk, D], this step's rows [2, N] int64 of each token's K and V): where a
        fused kernel writes K/V itself before ``attend``."""
        assert self._kv is not None, "plan() or plan_bucket() was not called"
        return self.kv_caches[layer].view(-1, self.num_kv_heads, self.head_dim), self._kv

    def attend_qkv(self, layer: int, qkv: Tensor, positions: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                   cos_sin: Tensor) -> Tensor | None:  # fmt: skip
        """qkv [N, (Hq + 2 Hk) D] -> [N, Hq*D]: QK-norm, RoPE, the K/V write into the rows ``kv_destination``
        gives and the attention in one launch, where this step's decode kernel does that (``triton``); else None,
        and the caller runs the fused kernel and ``attend``."""
        return None if self._attend_qkv is None else self._attend_qkv(layer, qkv, positions, q_weight, k_weight,
                                                                       eps, cos_sin)  # fmt: skip

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """q [N, Hq, D] -> [N, Hq*D] over the layer's cache, this step's K/V already in it."""
        assert self._attend is not None, "plan() or plan_bucket() was not called"
        return self._attend(q.contiguous(), self.kv_caches[layer]).reshape(q.shape[0], -1)

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [N, Hq, D], k/v [N, Hk, D] -> [N, Hq*D]; writes K/V into the layer's cache first."""
        flat, rows = self.kv_destination(layer)
        flat.index_copy_(0, rows[0], k.to(flat.dtype))
        flat.index_copy_(0, rows[1], v.to(flat.dtype))
        return self.attend(layer, q)

"""FlashInfer attention over the paged KV cache (CUDA).

Prefill runs FlashInfer's batched paged prefill. Decode runs, per padded batch bucket, either FlashInfer's
native paged decode kernel or its XQA route (``trtllm_batch_decode_with_kv_cache(backend="xqa")``). Which one
is chosen per bucket by measurement (``measure_decode_kernels``): both are timed inside CUDA graphs and checked
against an fp32 reference, and the faster correct one wins. XQA gets its own zeroed workspace: sharing the
native wrapper's made FlashInfer 0.6.13's XQA return wrong outputs (GPU.md).

``plan``-style work happens on the host in ``begin`` / ``begin_graph``; ``forward`` only launches kernels, so a
decode step captured in a CUDA graph replays with whatever the last ``begin_graph`` for its bucket set up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .attention import AttnMetadata
from .cuda_graphs.buckets import bucket_for
from .cuda_graphs.capture import capture_graph

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 256 * 1024 * 1024
KERNELS = ("native", "xqa")


@dataclass
class _GraphDecode:
    """Fixed device buffers of one bucket's decode (what a captured graph reads)."""

    batch: int
    kernel: str
    kv_index: Tensor  # [2, Bp] int64: flat cache row of each new K (row 0) and V (row 1)
    wrapper: object | None = None  # native: a use_cuda_graph decode wrapper
    block_tables: Tensor | None = None  # xqa: [Bp, max_blocks] int32
    seq_lens: Tensor | None = None  # xqa: [Bp] int32


class FlashInferAttention:
    """AttentionBackend for CUDA. ``scratch_block`` is a KV block no request owns (padding rows write there)."""

    plans_from_host = True  # begin/begin_graph read only the metadata's host lists

    def __init__(
        self,
        kv_caches: list[Tensor],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_model_len: int,
        scratch_block: int = 0,
        decode_kernel: str = "auto",
    ) -> None:
        import flashinfer

        if decode_kernel not in ("auto", *KERNELS):
            raise ValueError(f"decode_kernel must be 'auto', 'native' or 'xqa', got {decode_kernel!r}")
        self.fi = flashinfer
        self.kv_caches = kv_caches
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = kv_caches[0].shape[2]
        self.max_blocks = -(-max_model_len // self.block_size)
        self.max_model_len = max_model_len
        self.scratch_block = scratch_block
        self.decode_kernel = decode_kernel
        self.scale = head_dim**-0.5
        dev = self.device = kv_caches[0].device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.xqa_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)  # never shared
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.graph_decodes: dict[int, _GraphDecode] = {}
        self.kernel_for_bucket: dict[int, str] = {}
        self._mode = "none"
        self._slot: _GraphDecode | None = None
        self._kv_index: Tensor | None = None  # [2, N] of the current eager step

    # ------------------------------------------------------------------ host side

    def _paged(self, blocks: list[list[int]], seq_lens: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        indptr, indices, last = [0], [], []
        for bl, n in zip(blocks, seq_lens, strict=True):
            used = -(-n // self.block_size)
            indices += bl[:used]
            indptr.append(indptr[-1] + used)
            last.append(n - (used - 1) * self.block_size)
        as32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        return as32(indptr), as32(indices), as32(last)

    def _plan_native(self, wrapper, blocks: list[list[int]], seq_lens: list[int]) -> None:
        """Host-side plan of FlashInfer's native paged decode for these block lists and lengths."""
        indptr, indices, last = self._paged(blocks, seq_lens)
        dtype = self.kv_caches[0].dtype
        wrapper.plan(
            indptr,
            indices,
            last,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            pos_encoding_mode="NONE",
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=self.scale,
        )

    def _block_table(self, blocks: list[list[int]]) -> Tensor:
        """[rows, max_blocks] int32 block table (host); unused entries point at the scratch block."""
        table = np.full((len(blocks), self.max_blocks), self.scratch_block, dtype=np.int32)
        for i, bl in enumerate(blocks):
            table[i, : len(bl)] = bl
        return torch.from_numpy(table)

    def _kv_rows(self, slots: list[int]) -> Tensor:
        """[2, N] int64 (host): the flat cache rows of each new token's K and V (cache viewed as [-1, Hk, D])."""
        bs = self.block_size
        s = np.asarray(slots, dtype=np.int64)
        k = (s // bs) * (2 * bs) + s % bs
        return torch.from_numpy(np.stack([k, k + bs]))

    def begin(self, meta: AttnMetadata) -> None:
        """Eager step: plan prefill or decode for exactly this batch."""
        assert meta.blocks_host is not None, "FlashInfer needs the host block lists"
        self._kv_index = self._kv_rows(meta.slot_mapping_host).to(self.device, non_blocking=True)
        sizes = sorted(self.kernel_for_bucket)
        bucket = bucket_for(meta.num_reqs, sizes) if meta.is_decode_only else None
        if bucket is not None and self.kernel_for_bucket[bucket] == "xqa":
            self._xqa_tables = self._block_table(meta.blocks_host).to(self.device, non_blocking=True)
            self._xqa_lens = torch.tensor(meta.seq_lens_host, dtype=torch.int32).to(self.device, non_blocking=True)
            self._mode = "xqa"
        elif meta.is_decode_only:
            self._plan_native(self.decode, meta.blocks_host, meta.seq_lens_host)
            self._mode = "decode"
        else:
            indptr, indices, last = self._paged(meta.blocks_host, meta.seq_lens_host)
            dtype = self.kv_caches[0].dtype
            qo = torch.tensor([0, *torch.tensor(meta.query_lens_host).cumsum(0).tolist()], dtype=torch.int32)
            self.prefill.plan(
                qo,
                indptr,
                indices,
                last,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                causal=True,
                q_data_type=dtype,
                kv_data_type=dtype,
                sm_scale=self.scale,
            )
            self._mode = "prefill"

    def graph_decode(self, bucket: int, kernel: str | None = None) -> _GraphDecode:
        """The fixed buffers of ``bucket`` (created on first use with ``kernel``, default the bucket's choice)."""
        slot = self.graph_decodes.get(bucket)
        if slot is not None and (kernel is None or slot.kernel == kernel):
            return slot
        kernel = (
            kernel
            or self.kernel_for_bucket.get(bucket)
            or ("native" if self.decode_kernel == "auto" else self.decode_kernel)
        )
        dev = self.device
        slot = _GraphDecode(bucket, kernel, torch.zeros(2, bucket, dtype=torch.long, device=dev))
        if kernel == "native":
            slot.wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(bucket + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(bucket * self.max_blocks, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.zeros(bucket, dtype=torch.int32, device=dev),
            )
        else:
            slot.block_tables = torch.full((bucket, self.max_blocks), self.scratch_block, dtype=torch.int32, device=dev)
            slot.seq_lens = torch.ones(bucket, dtype=torch.int32, device=dev)
        self.graph_decodes[bucket] = slot
        return slot

    def begin_graph(self, meta: AttnMetadata | None, bucket: int) -> None:
        """Set up ``bucket``'s fixed buffers for ``meta`` (``None``: all padding rows), padded to the bucket."""
        slot = self.graph_decode(bucket)
        if meta is None:
            meta = AttnMetadata(None, None, None, None, [], [], [], [])
        if meta.num_reqs != bucket:
            meta = meta.padded(bucket, self.scratch_block, self.block_size)
        slot.kv_index.copy_(self._kv_rows(meta.slot_mapping_host), non_blocking=True)
        if slot.kernel == "native":
            self._plan_native(slot.wrapper, meta.blocks_host, meta.seq_lens_host)
        else:
            slot.block_tables.copy_(self._block_table(meta.blocks_host), non_blocking=True)
            slot.seq_lens.copy_(torch.tensor(meta.seq_lens_host, dtype=torch.int32), non_blocking=True)
        self._mode, self._slot = "graph", slot

    # ------------------------------------------------------------------ device side

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [N, Hq, D], k/v [N, Hk, D] -> [N, Hq*D]; writes K/V into the layer's cache first."""
        cache = self.kv_caches[layer]
        flat = cache.view(-1, self.num_kv_heads, self.head_dim)
        slot = self._slot if self._mode == "graph" else None
        kv_index = slot.kv_index if slot is not None else self._kv_index
        flat.index_copy_(0, kv_index[0], k.to(cache.dtype))
        flat.index_copy_(0, kv_index[1], v.to(cache.dtype))
        q = q.contiguous()
        if self._mode == "prefill":
            out = self.prefill.run(q, cache)
        elif self._mode == "decode":
            out = self.decode.run(q, cache)
        elif slot is not None and slot.kernel == "native":
            out = slot.wrapper.run(q, cache)
        else:
            tables, lens = (
                (slot.block_tables, slot.seq_lens) if slot is not None else (self._xqa_tables, self._xqa_lens)
            )
            out = self.fi.decode.trtllm_batch_decode_with_kv_cache(
                q,
                cache,
                self.xqa_workspace,
                tables,
                lens,
                self.max_model_len,
                bmm1_scale=self.scale,
                bmm2_scale=1.0,
                kv_layout="NHD",
                backend="xqa",
            )
        return out.reshape(q.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------
# measured kernel choice


def _time_graph(fn, iters: int = 20, repeats: int = 3) -> float:
    """Median microseconds per call of ``fn`` captured in a CUDA graph (warm-up excluded)."""
    graph, _ = capture_graph(fn)
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return sorted(times)[len(times) // 2]


L2_DEFEAT_BYTES = 256 * 1024 * 1024  # several times the H200's 50 MB L2


def _decode_case(
    attn: FlashInferAttention, batch: int, ctx: int, kernel: str, gen: torch.Generator
) -> tuple[float, float]:
    """(microseconds per call in a CUDA graph, rel. error vs fp32) of one decode kernel on random data.

    As in a real step (one call per layer, weights streaming in between), the KV must come from HBM, not L2:
    the graph cycles through enough distinct caches to exceed the L2 several times.
    """
    fi, dev, bs = attn.fi, attn.device, attn.block_size
    hq, hk, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    dtype = attn.kv_caches[0].dtype
    per_seq = -(-ctx // bs)
    cache = torch.randn(batch * per_seq, 2, bs, hk, d, generator=gen, device=dev).to(dtype)
    copies = max(1, min(36, -(-L2_DEFEAT_BYTES // (cache.numel() * cache.element_size()))))
    caches = [cache] + [torch.randn(cache.shape, generator=gen, device=dev).to(dtype) for _ in range(copies - 1)]
    q = torch.randn(batch, hq, d, generator=gen, device=dev).to(dtype)
    table = torch.arange(batch * per_seq, dtype=torch.int32, device=dev).view(batch, per_seq)
    kv = cache.view(batch, per_seq, 2, bs, hk, d)
    k = kv[:, :, 0].reshape(batch, -1, hk, d)[:, :ctx].float().transpose(1, 2)
    v = kv[:, :, 1].reshape(batch, -1, hk, d)[:, :ctx].float().transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, :, None], k, v, scale=attn.scale, enable_gqa=True
    ).squeeze(2)
    out = torch.empty(batch, hq, d, dtype=dtype, device=dev)
    if kernel == "native":
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            attn.workspace,
            "NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(batch * per_seq, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=dev),
        )
        indptr = torch.arange(0, batch * per_seq + 1, per_seq, dtype=torch.int32)
        last = torch.full((batch,), ctx - (per_seq - 1) * bs, dtype=torch.int32)
        w.plan(
            indptr,
            table.flatten().cpu(),
            last,
            hq,
            hk,
            d,
            bs,
            pos_encoding_mode="NONE",
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=attn.scale,
        )

        def fn() -> None:
            for c in caches:
                w.run(q, c, out=out)
    else:
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)

        def fn() -> None:
            for c in caches:
                fi.decode.trtllm_batch_decode_with_kv_cache(
                    q,
                    c,
                    attn.xqa_workspace,
                    table,
                    lens,
                    attn.max_model_len,
                    bmm1_scale=attn.scale,
                    bmm2_scale=1.0,
                    out=out,
                    kv_layout="NHD",
                    backend="xqa",
                )

    us = _time_graph(fn) / len(caches)
    del caches[1:]  # the timed calls ended on the last cache; recompute `out` from the first for the check
    fn()
    return us, ((out.float() - ref).norm() / ref.norm()).item()


def measure_decode_kernels(
    attn: FlashInferAttention, buckets: list[int], contexts: tuple[int, ...] = (512, 2048), tolerance: float = 2e-2
) -> list[dict]:
    """Time native vs XQA decode per bucket and context inside CUDA graphs, check each against an fp32
    reference, and record the faster correct kernel per bucket in ``attn.kernel_for_bucket``.

    Returns the measurement table (one dict per bucket x context x kernel). A forced ``decode_kernel`` skips
    the measurement. A kernel that raises or misses the tolerance is never chosen.
    """
    if attn.decode_kernel != "auto":
        attn.kernel_for_bucket = {b: attn.decode_kernel for b in buckets}
        return []
    gen = torch.Generator(device=attn.device).manual_seed(0)
    rows, totals = [], {}
    for ctx in sorted({min(c, attn.max_model_len) for c in contexts}):
        for b in buckets:
            for kernel in KERNELS:
                try:
                    us, err = _decode_case(attn, b, ctx, kernel, gen)
                    ok = err <= tolerance
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is simply not chosen
                    logger.warning("decode kernel %s failed at batch %d, context %d: %s", kernel, b, ctx, exc)
                    us, err, ok = float("inf"), float("nan"), False
                rows.append({"bucket": b, "context": ctx, "kernel": kernel, "us": us, "rel_err": err, "ok": ok})
                totals[b, kernel] = totals.get((b, kernel), 0.0) + (us if ok else float("inf"))
    for b in buckets:
        xqa, native = totals.get((b, "xqa"), float("inf")), totals.get((b, "native"), float("inf"))
        attn.kernel_for_bucket[b] = "xqa" if xqa < native else "native"
    lines = [
        f"  batch {r['bucket']:>3} ctx {r['context']:>5} {r['kernel']:>6}: {r['us']:8.1f} us"
        f"  err {r['rel_err']:.1e}{'' if r['ok'] else '  (rejected)'}"
        for r in rows
    ]
    chosen = ", ".join(f"{b}:{k}" for b, k in sorted(attn.kernel_for_bucket.items()))
    logger.info("decode kernels (CUDA graphs):\n%s\nchosen per bucket: %s", "\n".join(lines), chosen)
    return rows

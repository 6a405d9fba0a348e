"""Decode-kernel choice by measurement: per graph bucket, the fastest correct kernel of the attention backend.

Each candidate in ``backend.decode_kernels`` runs through the backend's own bucket path (``plan_bucket`` +
``forward``) on a fork of the backend over synthetic caches, timed inside a CUDA graph and checked against an
fp32 reference. As in a real step (one call per layer, weights streaming in between), the KV comes from HBM,
not L2: the fork has enough layers (distinct caches) to exceed the L2 several times.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from ..batch import StepBatch
from ..kv_cache import kv_slot
from .capture import capture_graph, median_ms

if TYPE_CHECKING:
    from ..attention import AttentionBackend

logger = logging.getLogger(__name__)

L2_DEFEAT_BYTES = 256 * 1024 * 1024  # several times the H200's 50 MB L2
MAX_LAYERS = 36


def _synthetic_batch(batch: int, ctx: int, block_size: int) -> StepBatch:
    """``batch`` requests of context ``ctx`` in consecutive blocks, each decoding its last position."""
    per_seq = -(-ctx // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    pos = ctx - 1
    return StepBatch(
        slots=[0] * batch,
        positions=[pos] * batch,
        slot_mapping=[kv_slot(t, pos, block_size) for t in tables],
        query_lens=[1] * batch,
        seq_lens=[ctx] * batch,
        block_tables=tables,
    )


def _reference(cache: Tensor, q: Tensor, batch: StepBatch, scale: float) -> Tensor:
    """fp32 decode attention of ``batch`` over ``cache`` [blocks, 2, bs, Hk, D] -> [B, Hq * D]."""
    hk, d = cache.shape[3], cache.shape[4]
    kv = cache[torch.tensor(batch.block_tables, device=cache.device)].float()  # [B, nb, 2, bs, Hk, D]
    ctx = batch.seq_lens[0]
    k = kv[:, :, 0].reshape(q.shape[0], -1, hk, d)[:, :ctx].transpose(1, 2)
    v = kv[:, :, 1].reshape(q.shape[0], -1, hk, d)[:, :ctx].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.float()[:, :, None], k, v, scale=scale, enable_gqa=True)
    return out.reshape(q.shape[0], -1)


def _measure(attn: AttentionBackend, size: int, ctx: int, kernel: str, gen: torch.Generator) -> tuple[float, float]:
    """(microseconds per call inside a CUDA graph, relative error vs fp32) of one kernel at one point."""
    ref_cache = attn.kv_caches[0]
    dev, dtype, bs = ref_cache.device, ref_cache.dtype, ref_cache.shape[2]
    hk, d = ref_cache.shape[3], ref_cache.shape[4]
    batch = _synthetic_batch(size, ctx, bs)
    shape = (size * -(-ctx // bs) + 1, 2, bs, hk, d)  # + the fork's scratch block
    nbytes = torch.Size(shape).numel() * ref_cache.element_size()
    layers = max(1, min(MAX_LAYERS, -(-L2_DEFEAT_BYTES // nbytes)))
    caches = [torch.randn(shape, generator=gen, device=dev).to(dtype) for _ in range(layers)]
    fork = attn.fork(caches)
    fork.set_bucket_kernel(size, kernel)
    fork.plan_bucket(batch)
    q = torch.randn(size, fork.num_heads, d, generator=gen, device=dev).to(dtype)
    k = torch.randn(size, hk, d, generator=gen, device=dev).to(dtype)
    v = torch.randn(size, hk, d, generator=gen, device=dev).to(dtype)

    def all_layers() -> None:
        for layer in range(layers):
            fork.forward(layer, q, k, v)

    graph, _ = capture_graph(all_layers)
    us = median_ms(lambda: [graph.replay() for _ in range(20)], iters=3) * 1e3 / (20 * layers)
    got = fork.forward(0, q, k, v)  # the new K/V are in the cache by now: the reference reads them
    want = _reference(caches[0], q, batch, fork.scale)
    return us, ((got.float() - want).norm() / want.norm()).item()


def choose_decode_kernels(
    attn: AttentionBackend, buckets: list[int], contexts: tuple[int, ...] = (512, 2048), tolerance: float = 2e-2
) -> list[dict]:
    """Give every bucket the faster correct kernel (summed over ``contexts``), via ``attn.set_bucket_kernel``.

    With one candidate there is nothing to measure. A kernel that raises or misses ``tolerance`` is never
    chosen. Returns the measurement table (one dict per bucket x context x kernel).
    """
    kernels = tuple(attn.decode_kernels)
    if len(kernels) == 1:
        for b in buckets:
            attn.set_bucket_kernel(b, kernels[0])
        return []
    gen = torch.Generator(device=attn.kv_caches[0].device).manual_seed(0)
    rows, totals = [], {}
    for ctx in sorted({min(c, attn.max_model_len) for c in contexts}):
        for b in buckets:
            for kernel in kernels:
                try:
                    us, err = _measure(attn, b, ctx, kernel, gen)
                    ok = err <= tolerance
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is simply not chosen
                    logger.warning("decode kernel %s failed at batch %d, context %d: %s", kernel, b, ctx, exc)
                    us, err, ok = float("inf"), float("nan"), False
                rows.append({"bucket": b, "context": ctx, "kernel": kernel, "us": us, "rel_err": err, "ok": ok})
                totals[b, kernel] = totals.get((b, kernel), 0.0) + (us if ok else float("inf"))
    chosen = {b: min(kernels, key=lambda k, b=b: (totals[b, k], kernels.index(k))) for b in buckets}
    for b, kernel in chosen.items():
        attn.set_bucket_kernel(b, kernel)
    lines = [
        f"  batch {r['bucket']:>3} ctx {r['context']:>5} {r['kernel']:>6}: {r['us']:8.1f} us"
        f"  err {r['rel_err']:.1e}{'' if r['ok'] else '  (rejected)'}"
        for r in rows
    ]
    summary = ", ".join(f"{b}:{k}" for b, k in chosen.items())
    logger.info("decode kernels (CUDA graphs):\n%s\nchosen per bucket: %s", "\n".join(lines), summary)
    return rows

"""Decode-kernel choice by measurement: per graph bucket, the fastest correct kernel of the attention backend.

Each candidate in ``backend.decode_kernels`` first runs alone through the backend's own bucket path
(``plan_bucket`` + ``forward``) on a fork of the backend over synthetic caches, timed inside a CUDA graph and
checked against an fp32 reference; a kernel that raises or misses the tolerance is never chosen. The KV comes
from HBM, not L2: the fork has enough layers (distinct caches) to exceed the L2 several times.

Alone is not how a kernel runs, though: in a step each attention call sits between weight-streaming GEMMs, and
on the H200 that costs XQA 9-22 us a layer more than alone (XQA, the fastest alone at batch 64, made the whole
step 10% slower than ``native_tc``). So where the caller gives a
``step`` (the graph runner gives the model's whole decode step), the correct kernels are timed inside it: one
CUDA graph of the whole step per (bucket, context, kernel), on the engine's own caches before any request
exists, and the choice goes by that time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
# (a decode batch of synthetic requests, planned) -> a function that runs the whole step once, graph-safe
StepFactory = Callable[[StepBatch], Callable[[], object]]


def synthetic_batch(batch: int, ctx: int, block_size: int, num_blocks: int | None = None) -> StepBatch:
    """``batch`` requests of context ``ctx`` in consecutive blocks, each decoding its last position (all on
    decode-state slot 0). With ``num_blocks`` the block ids wrap around a pool of that many blocks (requests then
    share blocks, and their K/V writes land in them)."""
    per_seq = -(-ctx // block_size)
    wrap = num_blocks or batch * per_seq
    tables = [[b % wrap for b in range(i * per_seq, (i + 1) * per_seq)] for i in range(batch)]
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
    batch = synthetic_batch(size, ctx, bs)
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


def _step_ms(attn: AttentionBackend, step: StepFactory, size: int, ctx: int, kernel: str) -> float:
    """Milliseconds of one replay of the whole decode step with this kernel (a CUDA graph of ``step``)."""
    block_size = attn.kv_caches[0].shape[2]
    batch = synthetic_batch(size, ctx, block_size, num_blocks=attn.scratch_block)
    attn.set_bucket_kernel(size, kernel)
    attn.plan_bucket(batch)
    graph, _ = capture_graph(step(batch))
    return median_ms(lambda: [graph.replay() for _ in range(3)], iters=3) / 3


def pick_kernels(rows: list[dict], kernels: tuple[str, ...], key: str) -> dict[int, str]:
    """Per bucket, the kernel with the least ``key`` summed over contexts among those that were ``ok`` at every
    context (ties: the earlier kernel in ``kernels``); a bucket where none was ok gets the first kernel."""
    totals: dict[tuple[int, str], float] = {}
    for r in rows:
        value = r.get(key, float("inf")) if r["ok"] else float("inf")
        totals[r["bucket"], r["kernel"]] = totals.get((r["bucket"], r["kernel"]), 0.0) + value
    buckets = sorted({b for b, _ in totals})
    return {b: min(kernels, key=lambda k, b=b: (totals.get((b, k), float("inf")), kernels.index(k))) for b in buckets}


def choose_decode_kernels(
    attn: AttentionBackend,
    buckets: list[int],
    contexts: tuple[int, ...] = (512, 2048),
    tolerance: float = 2e-2,
    step: StepFactory | None = None,
) -> list[dict]:
    """Give every bucket the faster correct kernel (summed over ``contexts``), via ``attn.set_bucket_kernel``.

    With one candidate there is nothing to measure. A kernel that raises or misses ``tolerance`` alone is never
    chosen. With ``step`` the others are timed inside the whole decode step (``step_ms``) and chosen by that,
    else by their time alone (``us``). ``step(batch)`` gets a planned batch of synthetic requests on the
    backend's own caches (block ids wrap around its pool) and returns a graph-safe function running the step.
    Returns the measurement table (one dict per bucket x context x kernel).
    """
    kernels = tuple(attn.decode_kernels)
    if len(kernels) == 1:
        for b in buckets:
            attn.set_bucket_kernel(b, kernels[0])
        return []
    gen = torch.Generator(device=attn.kv_caches[0].device).manual_seed(0)
    rows = []
    for ctx in sorted({min(c, attn.max_model_len) for c in contexts}):
        for b in buckets:
            for kernel in kernels:
                row = {"bucket": b, "context": ctx, "kernel": kernel}
                try:
                    row["us"], row["rel_err"] = _measure(attn, b, ctx, kernel, gen)
                    row["ok"] = row["rel_err"] <= tolerance
                    if row["ok"] and step is not None:
                        row["step_ms"] = _step_ms(attn, step, b, ctx, kernel)
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is simply not chosen
                    logger.warning("decode kernel %s failed at batch %d, context %d: %s", kernel, b, ctx, exc)
                    row.update(us=float("inf"), rel_err=float("nan"), ok=False)
                rows.append(row)
    chosen = pick_kernels(rows, kernels, "step_ms" if step is not None else "us")
    for b, kernel in chosen.items():
        attn.set_bucket_kernel(b, kernel)
    lines = [
        f"  batch {r['bucket']:>3} ctx {r['context']:>5} {r['kernel']:>17}: alone {r['us']:8.1f} us"
        + (f", step {r['step_ms']:.3f} ms" if "step_ms" in r else "")
        + f"  err {r['rel_err']:.1e}{'' if r['ok'] else '  (rejected)'}"
        for r in rows
    ]
    summary = ", ".join(f"{b}:{k}" for b, k in chosen.items())
    logger.info("decode kernels (CUDA graphs):\n%s\nchosen per bucket: %s", "\n".join(lines), summary)
    return rows

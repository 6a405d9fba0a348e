"""CUDA tests (run on the H200; skipped without CUDA): fused kernels, FlashInfer attention, graph modes."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import pytest
import torch
from _engine_invariants import engine_rows
from _qk_rope import check_qk_norm_rope_store
from _reference_check import ScoreBound, ScoreCheck, break_projection, float32_reference, score_bound
from _tolerance import kernel_rel_tol, rel_err

from higgs_talker import HiggsTalker, Reference, SamplingParams
from higgs_talker.config import TalkerConfig, TextConfig
from higgs_talker.cuda_graphs import PREFILL_BUCKETS
from higgs_talker.cuda_graphs.capture import capture_graph, graph_pool
from higgs_talker.flashinfer_attention import KERNELS
from higgs_talker.ops import FlashInferKernels, TorchKernels, rope_cache

pytestmark = pytest.mark.gpu

try:
    import flashinfer
except ImportError:  # the tests that need it skip one by one; SDPA on CUDA and the Triton kernels still run
    flashinfer = None
# Skips without FlashInfer on a CUDA machine (without CUDA, conftest skips every gpu test).
needs_flashinfer = pytest.mark.skipif(
    torch.cuda.is_available() and flashinfer is None, reason="needs FlashInfer (pip install 'higgs-talker[gpu]')"
)

# FlashInfer's norm, RoPE and activation kernels read bf16, compute in fp32 and round each output once to bf16
# (include/flashinfer/norm.cuh, pos_enc.cuh, activation.cuh); the torch reference runs in fp32 on the same
# bf16 values and is not rounded. So each output is within kernel_rel_tol(bf16, 1 rounding, ...) of it:
# u_bf16 = 2**-8 from the rounding, plus both sides' fp32 error (tens of fp32 u, under 2% of the total).
# Measured on the H200 (FlashInfer 0.6.18.post1, these inputs over 20 seeds): 1.59e-3 to 1.82e-3 for every
# kernel, 0.41-0.47 u, against bounds of 3.91e-3 to 3.97e-3 (the old threshold was 1e-2).
BF16 = torch.bfloat16
RSQRT_APPROX = 3  # rsqrt.approx.f32: relative error <= 2**-22.9, under 3 fp32 u
# RMSNorm: sum of squares over D (gamma_D), then / d, + eps, rsqrt, x * r, * w
NORM_OPS = 4 + RSQRT_APPROX
# SiLU-and-mul: __expf (2 + floor(1.2 |x|) ulp; randn inputs stay below |x| = 6, so 9 ulp = 18 u), 1 + e,
# a fast division (2 ulp = 4 u), the product
SILU_OPS = 18 + 1 + 4 + 1
# RoPE: x1 cos - x2 sin per pair, two products and a sum; the rotation keeps norms, so the pairs' absolute
# errors (3 u |(x1, x2)| each side) give a norm-wise 3 sqrt(2) u < 5 u
ROPE_OPS = 5


# the 4B shape's linears: name -> (weight rows, K)
LINEARS_4B = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}


@pytest.mark.parametrize("tile", range(3))
@pytest.mark.parametrize("linear", list(LINEARS_4B))
def test_row_linear_matches_float64_on_the_4b_shapes(linear, tile):
    """The one-row Triton GEMV (every tile warm-up tries) against a float64 product on the 4B shapes: one bf16
    rounding plus the fp32 sum of K products; gate_up with SiLU-and-mul after it: each half rounded, then the
    activation (SILU_OPS) rounded once more, counted as four roundings (SiLU's slope moves a half's rounding by
    up to about 1.3x for randn-sized inputs)."""
    triton_gemv = pytest.importorskip("higgs_talker.triton_gemv")
    n, k = LINEARS_4B[linear]
    silu = linear == "gate_up"
    g = torch.Generator(device="cuda").manual_seed(tile)
    x = torch.randn(1, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).bfloat16()
    want = x.double() @ w.double().T
    if silu:
        gate, up = want.to(BF16).double().chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
    got = triton_gemv.row_linear(x, w, config=triton_gemv.CONFIGS[tile], silu_mul=silu)
    assert got.shape == (1, n // 2 if silu else n) and got.dtype == BF16
    assert rel_err(got, want) <= kernel_rel_tol(BF16, 4 if silu else 1, [k], SILU_OPS if silu else 0)


@pytest.mark.parametrize("m", [16, 3])
@pytest.mark.parametrize("tile", range(3))
@pytest.mark.parametrize("linear", list(LINEARS_4B))
def test_few_rows_linear_matches_float64_on_the_4b_shapes(linear, tile, m):
    """The few-row tensor-core kernel (every tile warm-up tries) against a float64 product on the 4B shapes, a full
    16-row tile and a padded one, row by row, with the one-row GEMV's bounds. A tile may need more shared memory
    than the GPU has only for gate_up (SiLU-and-mul holds its two weight tiles): warm-up then skips it."""
    triton_gemv = pytest.importorskip("higgs_talker.triton_gemv")
    from triton.runtime.errors import OutOfResources

    n, k = LINEARS_4B[linear]
    silu = linear == "gate_up"
    g = torch.Generator(device="cuda").manual_seed(tile * 100 + m)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).bfloat16()
    want = x.double() @ w.double().T
    if silu:
        gate, up = want.to(BF16).double().chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
    try:
        got = triton_gemv.few_rows_linear(x, w, config=triton_gemv.FEW_ROW_CONFIGS[tile], silu_mul=silu)
    except OutOfResources as exc:
        assert silu and "shared memory" in str(exc), exc
        pytest.skip(f"gate_up's tile {triton_gemv.FEW_ROW_CONFIGS[tile]} does not fit this GPU: {exc}")
    assert got.shape == (m, n // 2 if silu else n) and got.dtype == BF16
    tol = kernel_rel_tol(BF16, 4 if silu else 1, [k], SILU_OPS if silu else 0)
    for i in range(m):
        assert rel_err(got[i], want[i]) <= tol, f"row {i}"


def medium_config(**text) -> TalkerConfig:
    base = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
    )
    base.update(text)
    return TalkerConfig(text=TextConfig(**base), eos_token_id=256)


# --------------------------------------------------------------------------------------------------- kernels


@needs_flashinfer
def test_fused_ops_match_torch_reference():
    fi, ref = FlashInferKernels(), TorchKernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 512, generator=g, device="cuda").bfloat16()
    r = torch.randn(37, 512, generator=g, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(512, generator=g, device="cuda")).bfloat16()
    norm_tol = kernel_rel_tol(BF16, 1, [512], NORM_OPS)  # 3.97e-3 (was 1e-2)
    assert rel_err(fi.rms_norm(x, w, 1e-6), ref.rms_norm(x.float(), w.float(), 1e-6)) <= norm_tol
    qkv = torch.randn(37, 8 * 64 + 2 * 2 * 64, generator=g, device="cuda").bfloat16()
    q = qkv[:, : 8 * 64].reshape(37, 8, 64)  # a strided view, as the model passes it
    wq = (1 + 0.1 * torch.randn(64, generator=g, device="cuda")).bfloat16()
    qk_norm_tol = kernel_rel_tol(BF16, 1, [64], NORM_OPS)  # per head, D = 64
    assert rel_err(fi.rms_norm(q, wq, 1e-6), ref.rms_norm(q.float(), wq.float(), 1e-6)) <= qk_norm_tol
    want_h, want_r = ref.fused_add_rms_norm(x.float(), r.float(), w.float(), 1e-6)
    got_h, got_r = fi.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    # the sum x + r is one fp32 add, rounded once to bf16 as the residual; the norm reads the fp32 sum
    assert rel_err(got_r, want_r) <= kernel_rel_tol(BF16, 1, [], 1)
    assert rel_err(got_h, want_h) <= kernel_rel_tol(BF16, 1, [512], 1 + NORM_OPS)
    cos_sin = rope_cache(64, 4096, 1e6, "cuda")
    pos = torch.randint(0, 4096, (37,), generator=g, device="cuda")
    qh = torch.randn(37, 8, 64, generator=g, device="cuda").bfloat16()
    kh = torch.randn(37, 2, 64, generator=g, device="cuda").bfloat16()
    wq_, wk_ = ref.rope(pos, qh.float(), kh.float(), cos_sin)
    gq, gk = fi.rope(pos, qh.clone(), kh.clone(), cos_sin)
    rope_tol = kernel_rel_tol(BF16, 1, [], ROPE_OPS)  # the cos/sin table is the same fp32 tensor on both sides
    assert rel_err(gq, wq_) <= rope_tol and rel_err(gk, wk_) <= rope_tol
    gu = torch.randn(37, 2 * 384, generator=g, device="cuda").bfloat16()
    assert rel_err(fi.silu_and_mul(gu), ref.silu_and_mul(gu.float())) <= kernel_rel_tol(BF16, 1, [], SILU_OPS)


@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_qk_norm_rope_store_matches_torch_reference(dtype, head_dim, n):
    """The Triton QK-norm + RoPE + K/V-write kernel against rms_norm, rope and index writes: Q and K within two
    roundings elementwise, V exact, unaddressed cache rows untouched (tests/_qk_rope.py derives the bound)."""
    triton_ops = pytest.importorskip("higgs_talker.triton_ops")
    check_qk_norm_rope_store(triton_ops.qk_norm_rope_store, "cuda", dtype, head_dim, n, seed=n)


def test_fused_qk_norm_rope_store_replays_in_a_cuda_graph():
    """Captured once over fixed buffers (positions and K/V rows as bucket views of larger ones, as the engine
    passes them), replayed after the buffers' contents change: exactly what an eager call on them gives."""
    triton_ops = pytest.importorskip("higgs_talker.triton_ops")
    g = torch.Generator(device="cuda").manual_seed(5)
    n, hq, hk, d = 3, 32, 8, 128
    qkv = torch.randn(n, (hq + 2 * hk) * d, generator=g, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(d, generator=g, device="cuda")).bfloat16()
    cos_sin = rope_cache(d, 4096, 1e6, "cuda")
    packed = torch.zeros(2, n, dtype=torch.long, device="cuda")  # (slots, positions), as DeviceBatch packs them
    kv_index = torch.zeros(2, 16, dtype=torch.long, device="cuda")  # the backend's fixed rows; a bucket reads [:, :n]
    cache = torch.zeros(64, hk, d, dtype=torch.bfloat16, device="cuda")

    def fill() -> None:
        packed[1].copy_(torch.randint(0, 4096, (n,), generator=g, device="cuda"))
        kv_index[:, :n].copy_(torch.randperm(64, generator=g, device="cuda")[: 2 * n].view(2, n))

    def call() -> torch.Tensor:
        return triton_ops.qk_norm_rope_store(qkv, packed[1], w, w, 1e-6, cos_sin, cache, kv_index[:, :n])

    fill()
    graph, out = capture_graph(call)
    fill()
    cache.zero_()
    graph.replay()
    got_q, got_cache = out.clone(), cache.clone()
    cache.zero_()
    assert torch.equal(got_q, call()) and torch.equal(got_cache, cache)


# --------------------------------------------------------------------------------------------------- attention

# Attention is not bounded usefully in the worst case: an output is a softmax-weighted average, and rounding the
# weights P to bf16 (tensor-core and XQA kernels do) moves it by up to u * sum(p |v|), which for random v is
# ~sqrt(context) times |out|. The rounding errors are independent, though, so the norm-wise error settles near
# u * sqrt(r / 3) for r rounding stages (bf16 SDPA measured 2.2e-3, one stage at 0.56 u; XQA with split KV up to
# 3.97e-3, attention_20261130-220134.json). This threshold, 1.28 u, is what the kernels were seen to meet
# (research runs in shared/GPU.md reached 4.9e-3), not a derived bound; a wrong mask or index is O(1).
ATTENTION_TOL = 5e-3


def _attention(caches, kernel: str, scratch_block: int, max_batch: int = 64, max_model_len: int = 8192):
    from higgs_talker.flashinfer_attention import FlashInferAttention

    return FlashInferAttention(caches, 32, 8, 128, max_model_len, scratch_block, kernel, max_batch)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("batch", [1, 4, 16, 64])
@pytest.mark.parametrize("ctx", [256, 1024, 4096])
@needs_flashinfer
def test_decode_kernels_vs_float64(kernel, batch, ctx):
    """Each decode kernel, through our backend's bucket buffers, against a float64 reference (bf16 <= 5e-3)."""
    out, want = _bucket_attention_and_float64(kernel, batch, ctx)
    assert rel_err(out, want) <= ATTENTION_TOL


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
@pytest.mark.parametrize("ctx", [1, 256, 1024, 4096])
@needs_flashinfer
def test_triton_attention_from_qkv_rows_vs_float64(batch, ctx):
    """The ``triton`` kernel taking the qkv rows (``attend_qkv``: QK-norm, RoPE and the new token's K/V write in its
    launch) through our bucket buffers, against float64: the same norms and rotation of the same rows, K/V into a
    float64 copy of the cache, attention over it (bf16 <= 5e-3); the written K within the separate kernel's
    bound (tests/_qk_rope.py), V equal to its qkv rows."""
    from _qk_rope import FUSED_OPS

    from higgs_talker.batch import StepBatch

    g = torch.Generator(device="cuda").manual_seed(batch * 11 + ctx)
    bs, per_seq, d = 16, -(-ctx // 16), 128
    cache = torch.randn(batch * per_seq + 1, 2, bs, 8, d, generator=g, device="cuda").bfloat16()
    attn = _attention([cache], "triton", scratch_block=batch * per_seq)
    attn.set_bucket_kernel(batch, "triton")
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    slots = [b[(ctx - 1) // bs] * bs + (ctx - 1) % bs for b in blocks]
    attn.plan_bucket(StepBatch(list(range(batch)), [ctx - 1] * batch, slots, [1] * batch, [ctx] * batch, blocks))
    qkv = torch.randn(batch, 48 * d, generator=g, device="cuda").bfloat16()
    positions = torch.randint(0, 32768, (batch,), generator=g, device="cuda")
    q_weight, k_weight = (1 + 0.1 * torch.randn(2, d, generator=g, device="cuda")).bfloat16()
    cos_sin = rope_cache(d, 32768, 1e6, "cuda")
    ref = cache.double()
    _, rows = attn.kv_destination(0)
    out = attn.attend_qkv(0, qkv, positions, q_weight, k_weight, 1e-6, cos_sin).view(batch, 32, d)
    q = TorchKernels.qk_norm_rope_store(qkv.double(), positions, q_weight.double(), k_weight.double(), 1e-6,
                                        cos_sin.double(), ref.view(-1, 8, d), rows)  # fmt: skip
    kv = ref[: batch * per_seq].view(batch, per_seq, 2, bs, 8, d)
    keys = kv[:, :, 0].reshape(batch, per_seq * bs, 8, d)[:, :ctx].transpose(1, 2).repeat_interleave(4, dim=1)
    values = kv[:, :, 1].reshape(batch, per_seq * bs, 8, d)[:, :ctx].transpose(1, 2).repeat_interleave(4, dim=1)
    want = torch.einsum("bht,bhtd->bhd", (torch.einsum("bhd,bhtd->bht", q, keys) / d**0.5).softmax(-1), values)
    assert rel_err(out, want) <= ATTENTION_TOL
    flat, ref_flat = cache.view(-1, 8, d), ref.view(-1, 8, d)
    normed = TorchKernels.rms_norm(qkv[:, 32 * d : 40 * d].double().view(batch, 8, d), k_weight.double(), 1e-6)
    pair = normed.abs()[..., : d // 2] + normed.abs()[..., d // 2 :]
    bound = kernel_rel_tol(torch.bfloat16, 2, [d], FUSED_OPS) * torch.cat([pair, pair], dim=-1)
    assert ((flat[rows[0]].double() - ref_flat[rows[0]]).abs() <= bound).all()
    assert torch.equal(flat[rows[1]], qkv[:, 40 * d :].view(batch, 8, d))


@pytest.mark.parametrize("kernel", ["native_tc", "native_tc_nosplit"])
@needs_flashinfer
def test_a_bucket_wrapper_over_a_stale_pinned_buffer_is_right_and_does_not_hang(kernel, monkeypatch):
    """FlashInfer's CUDA-graph plans write the tile tables of the real CTAs only and copy the whole pinned buffer
    to the device; without split-KV (``native_tc_nosplit``) no mask stops the padded CTAs, which then read the
    buffer's old bytes. Here every decode wrapper starts from a buffer of 0x01 bytes (as a reused pinned block may
    hold); ours are zeroed before their first plan (``flashinfer_attention._graph_wrapper``), so a padded batch of
    64 finishes at once and equals the float64 reference. The 10 s bound is a hang check on a ~50 us call: the same
    call on fresh buffers runs first, so that FlashInfer's JIT (minutes where its cache lacks the kernel) is not
    inside it."""
    import flashinfer

    _bucket_attention_and_float64(kernel, 64, 256)
    cls = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    init = cls.__init__

    def stale(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._pin_memory_int_workspace_buffer.fill_(1)

    monkeypatch.setattr(cls, "__init__", stale)
    start = time.monotonic()
    out, want = _bucket_attention_and_float64(kernel, 64, 256)
    assert time.monotonic() - start < 10 and rel_err(out, want) <= ATTENTION_TOL


def _bucket_attention_and_float64(kernel: str, batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's decode attention of ``batch`` random requests of context ``ctx`` through our bucket buffers,
    its float64 reference)."""
    from higgs_talker.batch import StepBatch

    g = torch.Generator(device="cuda").manual_seed(batch * 7 + ctx)
    bs, per_seq = 16, -(-ctx // 16)
    cache = torch.randn(batch * per_seq + 1, 2, bs, 8, 128, generator=g, device="cuda").bfloat16()
    attn = _attention([cache], kernel, scratch_block=batch * per_seq)
    attn.set_bucket_kernel(batch, kernel)
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    # the new token sits at position ctx - 1; its K/V are written by forward() before attending
    slots = [b[(ctx - 1) // bs] * bs + (ctx - 1) % bs for b in blocks]
    batch_ = StepBatch(list(range(batch)), [ctx - 1] * batch, slots, [1] * batch, [ctx] * batch, blocks)
    q = torch.randn(batch, 32, 128, generator=g, device="cuda").bfloat16()
    k = torch.randn(batch, 8, 128, generator=g, device="cuda").bfloat16()
    v = torch.randn(batch, 8, 128, generator=g, device="cuda").bfloat16()
    attn.plan_bucket(batch_)
    out = attn.forward(0, q, k, v).view(batch, 32, 128)
    kv = cache[: batch * per_seq].view(batch, per_seq, 2, bs, 8, 128).double()
    keys = kv[:, :, 0].reshape(batch, per_seq * bs, 8, 128)[:, :ctx].transpose(1, 2)  # [B, 8, ctx, 128]
    values = kv[:, :, 1].reshape(batch, per_seq * bs, 8, 128)[:, :ctx].transpose(1, 2)
    keys, values = keys.repeat_interleave(4, dim=1), values.repeat_interleave(4, dim=1)
    scores = torch.einsum("bhd,bhtd->bht", q.double(), keys) / 128**0.5
    want = torch.einsum("bht,bhtd->bhd", scores.softmax(-1), values)
    torch.cuda.synchronize()
    return out, want


@needs_flashinfer
def test_prefill_matches_sdpa_reference():
    from higgs_talker.attention import SdpaAttention
    from higgs_talker.batch import StepBatch

    g = torch.Generator(device="cuda").manual_seed(1)
    lens = [5, 33, 17]
    bs = 16
    blocks, nxt = [], 1
    for n in lens:
        k = -(-n // bs)
        blocks.append(list(range(nxt, nxt + k)))
        nxt += k
    cache_fi = torch.zeros(nxt, 2, bs, 8, 128, dtype=torch.bfloat16, device="cuda")
    cache_ref = cache_fi.clone()
    attn = _attention([cache_fi], "native", scratch_block=0)
    slots = [b[p // bs] * bs + p % bs for b, n in zip(blocks, lens, strict=True) for p in range(n)]
    n = sum(lens)
    positions = [p for m in lens for p in range(m)]
    batch = StepBatch([0, 1, 2], positions, slots, lens, lens, blocks, token_ids=[0] * n)
    q = torch.randn(n, 32, 128, generator=g, device="cuda").bfloat16()
    k = torch.randn(n, 8, 128, generator=g, device="cuda").bfloat16()
    v = torch.randn(n, 8, 128, generator=g, device="cuda").bfloat16()
    attn.plan(batch)
    got = attn.forward(0, q, k, v)
    ref = SdpaAttention([cache_ref], 32, 8, 128, 8192)
    ref.plan(batch)
    want = ref.forward(0, q.float(), k.float(), v.float())
    assert rel_err(got, want) <= ATTENTION_TOL


# --------------------------------------------------------------------------------------------------- graph modes

MODES = ("eager", "local_mlp", "full_decode", "auto")


def _talker(mode: str = "auto", decode_kernel: str = "xqa", **options) -> HiggsTalker:
    """The suite's talker in ``mode``. Every mode pins one decode kernel (XQA) and the one-row GEMV on every linear
    (``row_gemv="on"``), so that modes compare on the same kernels (two kernels round differently, and a greedy
    code can flip at a near tie) and the suite spends no time measuring them; ``"auto"`` measures them (the CUDA
    defaults)."""
    options = {"row_gemv": "on", **options}
    return HiggsTalker.from_config(
        medium_config(), device="cuda", graph_mode=mode, max_num_seqs=64, max_model_len=1024, seed=0,
        decode_kernel=decode_kernel, **options,
    )  # fmt: skip


def _lazy_talkers(**options) -> dict[str, HiggsTalker]:
    """One talker per mode (``_talker``), built on first use."""

    class Lazy(dict):
        def __missing__(self, mode: str) -> HiggsTalker:
            self[mode] = _talker(mode, **options)
            return self[mode]

    return Lazy()


@pytest.fixture(scope="module")
def talkers():
    """The CUDA defaults (QK-norm, RoPE and the K/V writes in one Triton kernel where triton imports), one per
    mode."""
    return _lazy_talkers()


# option: (our module, its entry points the model calls, the value that turns it on, the one that turns it off,
# the most rows a step may have for the kernel to run: our linears take steps of at most 16 rows)
KERNEL_OPTIONS = {
    "fuse_qk_rope": ("triton_ops", ["qk_norm_rope_store"], True, False, None),
    "row_gemv": ("triton_gemv", ["row_linear", "few_rows_linear"], "on", "off", 16),
}


@pytest.fixture(scope="module")
def option_talkers():
    """``option_talkers(name)``: the suite's talkers (``talkers``: every option on) with one kernel option off
    (``fuse_qk_rope``: QK-norm, RoPE and the K/V writes in one Triton kernel; ``row_gemv``: the one-row GEMV and the
    few-row kernel)."""
    built = {}

    def get(option: str) -> dict[str, HiggsTalker]:
        if option not in built:
            built[option] = _lazy_talkers(**{option: KERNEL_OPTIONS[option][3]})
        return built[option]

    return get


def _schedule_inputs(talker: HiggsTalker, batch: int) -> tuple[list, list[SamplingParams]]:
    """The prompts and sampling parameters of ``_run_schedule`` (greedy; max_frames differ)."""
    params = [SamplingParams(temperature=0, max_frames=64 + (i * 5) % 23) for i in range(batch)]
    prompts = [talker.build_prompt(f"request number {i} " * (1 + i % 3)) for i in range(batch)]
    return prompts, params


def _run_schedule(talker: HiggsTalker, batch: int) -> dict[str, list]:
    """Half the requests start at once, the rest join after 7 steps; max_frames differ, so some finish early."""
    eng = talker.engine
    prompts, params = _schedule_inputs(talker, batch)
    ids, first = [], (batch + 1) // 2
    for i in range(first):
        ids.append(eng.add_request(prompts[i], params[i], request_id=f"r{i}"))
    steps = 0
    while eng.has_unfinished() or len(ids) < batch:
        if steps == 7:
            for i in range(first, batch):
                ids.append(eng.add_request(prompts[i], params[i], request_id=f"r{i}"))
        eng.step()
        steps += 1
    return {i: [r.tolist() for r in eng.pop_finished(i).rows] for i in ids}


@pytest.mark.parametrize("batch", [1, 3, 8, 13, 37, 64])
@needs_flashinfer
def test_graph_modes_give_identical_greedy_codes(talkers, batch):
    results = {m: _run_schedule(talkers[m], batch) for m in MODES}
    assert min(len(r) for r in results["eager"].values()) >= 8
    for m in MODES[1:]:
        for rid, rows in results["eager"].items():
            assert results[m][rid] == rows, f"mode {m} differs from eager for request {rid} at batch {batch}"


@pytest.mark.parametrize("option", list(KERNEL_OPTIONS))
@pytest.mark.parametrize("mode", ["eager", "full_decode"])
@pytest.mark.parametrize("batch", [1, 13, 64])
@needs_flashinfer
def test_kernel_options_on_and_off_give_equal_greedy_codes(
    talkers, option_talkers, score_check, option, mode, batch, monkeypatch
):
    """The A/B switch of each of our Triton kernel options: on and off, the same greedy codes, or codes that
    leave the ones without it only at a provable near tie. The fused QK-norm kernel rounds where the separate
    kernels store, but sums its squares in another order than FlashInfer's norm kernel, which moves a bf16
    element by one ulp now and then; over 64 requests x ~70 steps such a difference can reach a code whose two
    best scores are that close (seen on the H200: batch 64, one request, row 65, codebook 6, where the two best
    logits were both 1.015625, an exact tie). Where a request's codes differ, both runs are checked against the
    float32 reference teacher-forced on their rows (``assert_same_or_near_tie``). The one-row GEMV and the few-row
    kernel (batch 13: a 16-row bucket) round where cuBLAS stores, and sum in another order.
    """
    module_name, entries, on_value, off_value, max_rows = KERNEL_OPTIONS[option]
    module = pytest.importorskip(f"higgs_talker.{module_name}")
    on_set, off_set = talkers, option_talkers(option)
    on, off = on_set[mode], off_set[mode]
    assert getattr(on.model.kernels, option) == on_value and getattr(off.model.kernels, option) == off_value
    calls = []
    for entry in entries:
        real = getattr(module, entry)
        monkeypatch.setattr(module, entry, lambda *a, _real=real, **kw: calls.append(1) or _real(*a, **kw))
    got = _run_schedule(on, batch)
    # eager: every layer of every step (of at most max_rows rows) calls it; full_decode replays every step,
    # prefills included, from graphs captured with it (each checked against an eager run of it at capture), so no
    # call reaches Python there. At batch 64 three requests share the longest max_frames: no step has 16 rows or
    # fewer.
    assert calls or mode != "eager" or batch > (max_rows or batch), f"{option}: our kernel never ran"
    monkeypatch.undo()
    want = _run_schedule(off, batch)
    assert_same_or_near_tie(got, want, on, off, score_check, batch)


@pytest.mark.parametrize("mode", ["eager", "full_decode"])
@needs_flashinfer
def test_pdl_launches_give_the_same_greedy_codes(mode, monkeypatch):
    """Programmatic dependent launch of our one-row GEMV and decode attention (``higgs_talker.pdl``) changes when a
    kernel starts, never what it computes: with it, the greedy codes of 1 and 13 requests equal those without it,
    bit for bit, run eagerly and replayed from graphs captured with it (a kernel reading before its wait would race
    the one before it)."""
    from higgs_talker import pdl

    runs = {}
    for on in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", on)
        talker = _talker(mode, decode_kernel="triton")
        runs[on] = [_run_schedule(talker, batch) for batch in (1, 13)]
        del talker
        gc.collect()
        torch.cuda.empty_cache()
    assert runs[True] == runs[False]


@pytest.fixture(scope="module")
def score_check(talkers) -> ScoreCheck:
    """Runs whose codes differ, checked against the float32 reference of the suite's weights (every talker here is
    ``medium_config`` drawn with seed 0: the same weights), teacher-forced on their rows (``_reference_check``)."""
    eager = talkers["eager"]
    return ScoreCheck(float32_reference(eager), score_bound(eager))


def assert_same_or_near_tie(
    got: dict, want: dict, got_talker: HiggsTalker, want_talker: HiggsTalker, check: ScoreCheck, batch: int
) -> None:
    """Two ``_run_schedule`` results agree, request by request; where a request's rows differ, each side's talker
    (its kernels, run eagerly) teacher-forced on its rows gives every row's logits within the measured bf16 error
    of the float32 reference, and every code it took scores near the reference's best (``ScoreCheck``)."""
    prompts, params = _schedule_inputs(got_talker, batch)
    for rid, rows in want.items():
        if got[rid] == rows:
            continue
        i = int(rid[1:])
        check.check(got_talker, prompts[i], params[i], torch.tensor(got[rid]), f"request {rid}, first run")
        check.check(want_talker, prompts[i], params[i], torch.tensor(rows), f"request {rid}, second run")


def _check_schedule(
    talker: HiggsTalker, reference: HiggsTalker, batch: int, params=None, bound: ScoreBound | None = None
) -> ScoreCheck:
    """``ScoreCheck`` on every request of a schedule of ``talker``, whether or not its codes differ from anything;
    ``params``: one SamplingParams for all (default: the schedule's greedy ones)."""
    prompts, own = _schedule_inputs(talker, batch)
    check = ScoreCheck(reference, bound or score_bound(talker))
    runs = engine_rows(talker, prompts, [params or p for p in own])  # every request popped before any check
    for i, rows in enumerate(runs):
        check.check(talker, prompts[i], params or own[i], rows, f"request {i}")
    return check


DEPLOY = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=11, max_frames=40)
FOUR_B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
              num_key_value_heads=8, head_dim=128)  # fmt: skip


@needs_flashinfer
@pytest.mark.parametrize("name", ["o_proj", "down_proj"])
def test_the_reference_check_passes_bf16_kernels_and_fails_a_model_off_by_5_percent(talkers, name, capsys):
    """The check every code comparison here falls back to (``assert_same_or_near_tie``), on all 13 requests of a
    schedule whether their codes differ or not: the bf16 kernels of ``auto`` (graphs, batched) and of ``eager``
    pass it, greedy and with the deploy sampling, and print the errors they measured (the numbers behind
    ``SCORE_BOUNDS``); ``auto`` with one layer's ``name`` scaled by 1.05 (0.95 for down_proj) fails it."""
    reference = float32_reference(talkers["eager"])
    for mode in ("auto", "eager"):
        for params in (None, DEPLOY):
            check = _check_schedule(talkers[mode], reference, 13, params)
            with capsys.disabled():
                print(f"\n[score error] medium {mode} {'deploy' if params else 'greedy'}: worst row "
                      f"{check.worst_row:.4g}, overall {check.overall:.4g} ({check.bound})")  # fmt: skip
    factor = 1.05 if name == "o_proj" else 0.95
    broken = break_projection(_talker("auto"), name, 1, factor)
    with pytest.raises(AssertionError, match="from the float32 reference|far from the reference") as failed:
        _check_schedule(broken, reference, 13)
    with capsys.disabled():
        print(f"[score error] medium auto, {name} x {factor}: {str(failed.value).splitlines()[0]}")


def four_b_talker() -> HiggsTalker:
    """The 4B shape (random bf16 weights, eager, the CUDA kernels; vocabulary cut to the tiny tokenizer's)."""
    return HiggsTalker.from_config(medium_config(**FOUR_B), device="cuda", graph_mode="eager", max_num_seqs=4,
                                   max_model_len=512, seed=0, row_gemv="on")  # fmt: skip


@pytest.fixture(scope="module")
def four_b() -> tuple[HiggsTalker, HiggsTalker]:
    """``four_b_talker`` and its float32 reference, built once for both samplings."""
    talker = four_b_talker()
    return talker, float32_reference(talker)


@needs_flashinfer
@pytest.mark.parametrize("sampling", ["greedy", "deploy"])
def test_the_reference_check_at_the_4b_shape(four_b, sampling, capsys):
    """Four requests at the 4B shape, greedy or the deploy sampling: the errors of correct kernels against the
    float32 reference are printed and stay within ``SCORE_BOUNDS``, and one layer's o_proj x 1.25 exceeds them.
    (At 36 layers bf16 rounding alone is 2.7% of the logits, so a 5% change of one projection in one layer, which
    the shallow shapes' bounds catch, adds too little to stand out here: seen 0.0270 -> 0.0290 overall on the
    H200.)"""
    talker, reference = four_b
    bound = score_bound(talker)
    unbounded = ScoreBound(row=float("inf"), overall=float("inf"), code=float("inf"))
    params = SamplingParams(temperature=0, max_frames=40) if sampling == "greedy" else DEPLOY
    correct = _check_schedule(talker, reference, 4, params, unbounded)
    o_proj = [w for n, w in talker.model.named_parameters() if "layers.17." in n and "o_proj" in n]
    saved = [w.detach().clone() for w in o_proj]
    try:
        broken = _check_schedule(break_projection(talker, "o_proj", 17, 1.25), reference, 4, params, unbounded)
    finally:
        with torch.no_grad():
            for w, keep in zip(o_proj, saved, strict=True):
                w.copy_(keep)  # the fixture's talker serves the next sampling unbroken
    with capsys.disabled():
        print(f"\n[score error] 4b eager {sampling}: worst row {correct.worst_row:.4g}, overall {correct.overall:.4g}; "
              f"o_proj x 1.25: worst row {broken.worst_row:.4g}, overall {broken.overall:.4g} ({bound})")  # fmt: skip
    assert correct.worst_row <= bound.row and correct.overall <= bound.overall
    assert broken.overall > bound.overall


@pytest.mark.parametrize("mode", ["eager", "full_decode", "auto"])
@pytest.mark.parametrize("batch", [1, 13, 64])
@needs_flashinfer
def test_async_scheduling_gives_the_codes_of_synchronous_steps(talkers, score_check, mode, batch):
    """Asynchronous scheduling (the CUDA default) against synchronous steps on the same talker: the same greedy
    codes. Requests that join are prefilled one decode step later than in a synchronous run (the step queued
    ahead runs first), so other requests' steps can run in another bucket; where a code flips, both runs are
    checked against the float32 reference (``assert_same_or_near_tie``)."""
    talker = talkers[mode]
    eng = talker.engine
    assert eng.async_scheduling
    got = _run_schedule(talker, batch)
    eng.async_scheduling = False
    try:
        want = _run_schedule(talker, batch)
    finally:
        eng.async_scheduling = True
    assert eng._ahead is None and not eng.scheduler._unpublished
    assert_same_or_near_tie(got, want, talker, talker, score_check, batch)


@pytest.mark.parametrize("kernel", KERNELS)
@needs_flashinfer
def test_queueing_a_decode_step_never_synchronizes(kernel, monkeypatch):
    """Asynchronous scheduling overlaps only if queueing a step never waits for the device. FlashInfer's CUDA-graph
    decode ``plan()`` copies page indices that are on the host with a blocking copy (a stream sync), so the
    backend uploads them itself; torch's sync debug mode raises on any synchronizing torch call while decode
    steps are queued (planned, inputs copied, graph replayed, rows' copy to the host queued)."""
    talker = HiggsTalker.from_config(
        medium_config(), device="cuda", graph_mode="full_decode", decode_kernel=kernel, max_num_seqs=8,
        max_model_len=512, seed=0, buckets=(1, 2, 4, 8),
    )  # fmt: skip
    eng = talker.engine
    for i, text in enumerate(["one", "and two", "three, four and five"]):
        params = SamplingParams(temperature=1.0, seed=i, max_frames=30, min_frames=30)
        eng.add_request(talker.build_prompt(text), params)
    for _ in range(4):  # the prefill and the first decodes: every first-use check is behind us
        eng.step()
    real, queued = eng._launch, []

    def launch(batch):
        if not batch.is_decode:
            return real(batch)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = real(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        queued.append(batch.num_reqs)
        return out

    monkeypatch.setattr(eng, "_launch", launch)
    for _ in range(8):
        eng.step()
    assert len(queued) == 8 and set(queued) == {3}
    for rid in list(eng.requests):
        eng.cancel(rid)


@needs_flashinfer
def test_auto_chooses_each_buckets_kernel_by_its_whole_decode_step():
    """decode_kernel="auto" times every correct decode kernel inside the model's whole decode step (a graph per
    bucket, context and kernel) and gives each bucket the one with the least summed step time; the talker then
    gives the codes of an eager talker on the same per-bucket kernels."""
    from higgs_talker.cuda_graphs.kernels import pick_kernels

    talker = _talker("auto", decode_kernel="auto")
    rows, attn = talker.engine.graphs.kernel_timings, talker.engine.runner.attn
    kernels = attn.decode_kernels
    assert len(kernels) >= 2 and {r["kernel"] for r in rows} == set(kernels)
    ok = [r for r in rows if r["ok"]]
    assert ok and all(0 < r["step_ms"] < 1e3 for r in ok)
    assert {r["context"] for r in rows} == {512, 1024}  # (512, 2048) capped at max_model_len
    bs = talker.engine.runner.block_size
    assert all(-(-r["step_context"] // bs) * r["bucket"] <= attn.scratch_block for r in ok)  # no shared blocks
    assert attn.bucket_kernel == pick_kernels(rows, kernels, "step_ms")
    eager = _talker("eager", decode_kernel="auto")
    for size, kernel in attn.bucket_kernel.items():
        eager.engine.runner.attn.set_bucket_kernel(size, kernel)
    for batch in (1, 13, 64):
        assert _run_schedule(talker, batch) == _run_schedule(eager, batch), f"batch {batch}"


@needs_flashinfer
def test_warm_up_gives_one_and_few_row_inputs_our_kernels_where_they_measured_faster(talkers, option_talkers, caplog):
    """row_gemv="auto" times each linear's cuBLAS path and every correct tile over all layers, on one row and on 16
    rows, and gives the linear the fastest tile where it beat cuBLAS; "on" (the suite's talkers) gives every linear
    the first correct tile of each kernel without timing; "off" none. A tile too large for the GPU's shared memory
    is recorded as failed and logged as information, not as a warning (it is an expected outcome of the search)."""
    from higgs_talker.cuda_graphs.kernels import ROW_LINEARS
    from higgs_talker.triton_gemv import CONFIGS, FEW_ROW_CONFIGS, FEW_ROWS

    with caplog.at_level(logging.INFO, logger="higgs_talker.cuda_graphs.kernels"):
        talker = _talker("eager", row_gemv="auto")
    searched = [r for r in caplog.records if "-row linear" in r.getMessage() or "one-row GEMV" in r.getMessage()]
    assert searched and not [r for r in searched if r.levelno >= logging.WARNING], caplog.text
    kernels, rows = talker.model.kernels, talker.engine.graphs.row_timings
    assert [(r["linear"], r["rows"]) for r in rows] == [(n, m) for m in (1, FEW_ROWS) for n in ROW_LINEARS]
    for r in rows:
        configs, chosen = (
            (CONFIGS, kernels.row_configs) if r["rows"] == 1 else (FEW_ROW_CONFIGS, kernels.few_row_configs)
        )
        tiles = {key[2:]: us for key, us in r.items() if key.startswith("us(")}
        failed = {key[6:]: why for key, why in r.items() if key.startswith("failed(")}
        assert sorted([*tiles, *failed]) == sorted(str(tuple(c)) for c in configs), r  # each tile timed or failed
        assert tiles and all(0 < us < 1e4 for us in [*tiles.values(), r["torch_us"]])
        # only gate_up's few-row tiles may not fit (two weight tiles), and only for shared memory
        assert not failed or (r["linear"] == "gate_up" and r["rows"] > 1 and "shared memory" in str(failed)), failed
        best = min(tiles, key=tiles.get)
        assert r["chosen"] == (best if tiles[best] < r["torch_us"] else "torch")
        assert r["chosen"] == (str(tuple(chosen[r["linear"]])) if r["linear"] in chosen else "torch")
    on = talkers["eager"].model.kernels
    assert on.row_configs == dict.fromkeys(ROW_LINEARS, CONFIGS[0])
    assert on.few_row_configs == dict.fromkeys(ROW_LINEARS, FEW_ROW_CONFIGS[0])
    off = option_talkers("row_gemv")["eager"]
    assert off.model.kernels.row_configs == off.model.kernels.few_row_configs == {}
    assert off.engine.graphs.row_timings == []


@needs_flashinfer
def test_graphs_were_captured(talkers):
    local = talkers["local_mlp"].engine.graphs
    full = talkers["full_decode"].engine.graphs
    assert local.local is not None and not local.local.failed and len(local.local.buckets) == 7
    assert full.full is not None and not full.full.failed and len(full.full.graphs) == 7
    assert len(full.full.variants) == 14 and not full.full.failed_variants  # no-filter and greedy samplers
    assert full.local is None  # policy: the local path is off under full-decode graphs
    auto = talkers["auto"].engine.graphs
    assert set(auto.choice) == set(auto.buckets)


@needs_flashinfer
def test_a_dropped_graph_leaves_the_runners_pool_usable():
    """A capture that fails its check drops its graph; when that was the pool's only graph, later captures into
    the same pool still work (``graph_pool``: the pool lives as long as its owner, not its graphs)."""
    pool = graph_pool()
    x = torch.arange(8.0, device="cuda")
    dropped, _ = capture_graph(lambda: x * 2, pool.id)
    del dropped
    gc.collect()
    graph, out = capture_graph(lambda: x * 3 + 1, pool.id)
    graph.replay()
    torch.testing.assert_close(out, x * 3 + 1, rtol=0, atol=0)


@pytest.fixture(scope="module")
def prefill_graph_talker(talkers):
    """The ``auto`` talker: prefill graphs (``PREFILL_BUCKETS``) by default."""
    return talkers["auto"]


@pytest.fixture(scope="module")
def unpadded_talker():
    """The ``auto`` talker's settings without prefill token buckets: every prefill unpadded and eager."""
    return _talker(prefill_buckets=())


def _require_prefill_graphs(talker: HiggsTalker) -> None:
    """Every prefill bucket captured and checked, and the decode graphs captured after them in the same pool (a
    test of codes through prefill graphs is only one if prefills replay them)."""
    graphs = talker.engine.graphs
    assert graphs.prefill is not None and not graphs.prefill.failed, graphs.prefill and graphs.prefill.failed
    assert graphs.prefill.sizes == graphs.prefill_buckets == PREFILL_BUCKETS
    assert graphs.full is not None and not graphs.full.failed and len(graphs.full.graphs) == 7


@needs_flashinfer
def test_prefill_graphs_were_captured(talkers, unpadded_talker):
    for mode in ("full_decode", "auto"):  # the default in the modes that graph whole steps
        _require_prefill_graphs(talkers[mode])
    for mode in ("eager", "local_mlp"):  # the others pad prefills to the same buckets and run them eagerly
        graphs = talkers[mode].engine.graphs
        assert graphs.prefill is None and graphs.prefill_buckets == PREFILL_BUCKETS
    assert unpadded_talker.engine.graphs.prefill is None and unpadded_talker.engine.graphs.prefill_buckets == ()


@pytest.fixture(scope="module")
def prefix_cache_talker():
    """The ``auto`` talker's settings with prefix caching."""
    return _talker(prefix_caching=True)


@pytest.mark.parametrize("batch", [1, 13, 64])
@needs_flashinfer
def test_prefix_cache_hits_give_the_codes_of_full_prefills(
    talkers, prefix_cache_talker, score_check, batch, monkeypatch
):
    """The schedule twice through a prefix-caching talker (the second time every prompt is found in the cache,
    so FlashInfer's prefill attends over cached context) against ``auto`` without the cache. The suffix's
    GEMMs see other row counts than a full prefill's; where a code flips, both runs are checked against the
    float32 reference (``assert_same_or_near_tie``)."""
    from higgs_talker.scheduler import Scheduler

    hits, real = [], Scheduler._cache_hits

    def counted(self, req):
        found = real(self, req)
        hits.append(len(found))
        return found

    monkeypatch.setattr(Scheduler, "_cache_hits", counted)
    first = _run_schedule(prefix_cache_talker, batch)
    again = _run_schedule(prefix_cache_talker, batch)
    monkeypatch.undo()
    assert max(hits) > 0, "the second run should have found its prompts in the cache"
    want = _run_schedule(talkers["auto"], batch)
    for got in (first, again):
        assert_same_or_near_tie(got, want, prefix_cache_talker, talkers["auto"], score_check, batch)


def _reference_prompts(talker: HiggsTalker, n: int) -> list:
    """Prompts with reference audio codes of different lengths (their prefills embed audio rows)."""
    g = torch.Generator().manual_seed(5)
    prompts = []
    for i in range(n):
        codes = torch.randint(0, talker.cfg.num_real_codes, (3 + 7 * i, talker.cfg.num_codebooks), generator=g)
        prompts.append(talker.build_prompt(f"reference prompt {i} " * (1 + i % 2), Reference(codes, "ref words")))
    return prompts


@pytest.mark.parametrize("batch", [1, 13, 64])
@needs_flashinfer
def test_prefill_graphs_give_the_codes_of_unpadded_prefills(prefill_graph_talker, unpadded_talker, score_check, batch):
    """Prefill graphs against unpadded eager prefills (``auto`` without them): the same greedy codes. The two
    plan FlashInfer's prefill attention for different row counts; where a code flips, both runs are checked
    against the float32 reference (``assert_same_or_near_tie``)."""
    _require_prefill_graphs(prefill_graph_talker)
    got = _run_schedule(prefill_graph_talker, batch)
    want = _run_schedule(unpadded_talker, batch)
    assert_same_or_near_tie(got, want, prefill_graph_talker, unpadded_talker, score_check, batch)


@needs_flashinfer
def test_prefill_graphs_with_reference_audio_give_the_codes_of_unpadded_prefills(
    prefill_graph_talker, unpadded_talker, score_check
):
    """Prompts with audio rows, alone and five at once (one prefill step), through the prefill graphs."""
    _require_prefill_graphs(prefill_graph_talker)
    params = SamplingParams(temperature=0, max_frames=24)
    prompts = _reference_prompts(prefill_graph_talker, 5)
    for group in ([prompts[0]], [prompts[3]], prompts):
        got = engine_rows(prefill_graph_talker, group, params)
        want = engine_rows(unpadded_talker, group, params)
        for prompt, a, b in zip(group, got, want, strict=True):
            if torch.equal(a, b):
                continue
            score_check.check(prefill_graph_talker, prompt, params, a, "prefill graphs")
            score_check.check(unpadded_talker, prompt, params, b, "unpadded prefills")


@pytest.mark.parametrize("cached", [False, True])
@needs_flashinfer
def test_prefill_graph_replay_equals_the_eager_padded_prefill(prefill_graph_talker, prefix_cache_talker, cached):
    """The graph of a bucket, replayed on a real padded prefill, gives the rows of the same padded batch run
    eagerly (same plan, same kernels, the whole sampler as in the graph, so the padding rows too): exactly, and
    the real requests' K/V in the cache equal too. ``cached``: prefix-cache hits, whose queries follow cached
    blocks (the graph was captured and checked without any context)."""
    talker = prefix_cache_talker if cached else prefill_graph_talker
    eng, graphs = talker.engine, talker.engine.graphs
    runner = eng.runner
    prompts = _reference_prompts(talker, 2) + [talker.build_prompt("a plain text prompt")]
    if cached:  # the same prompts once before: their full blocks are in the cache now
        engine_rows(talker, prompts, SamplingParams(temperature=0, max_frames=2))
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_frames=4)) for p in prompts]
    outputs = []
    batch = eng.scheduler.schedule(outputs)
    assert batch is not None and not batch.is_decode and batch.num_reqs == 3
    assert (batch.query_lens != batch.seq_lens) == cached
    size = graphs.prefill_bucket_for(batch)
    assert size is not None and size in graphs.prefill.graphs
    padded = runner.padded_prefill(batch, size)
    real = sorted({b for t in batch.block_tables for b in t})
    slots = list(batch.slots)
    with torch.inference_mode(), runner.slots.preserved(slots + [runner.slots.scratch]):
        runner.slots.reset(padded.new_slots)
        runner.attn.plan_prefill_bucket(padded)
        want = runner.forward(dataclasses.replace(padded, draw=True, filter=True).to_device(runner.device)).clone()
        want_kv = [c[real].clone() for c in runner.kv_caches]
    with torch.inference_mode(), runner.slots.preserved(slots + [runner.slots.scratch]):
        runner.slots.reset(padded.new_slots)
        got = graphs.prefill.run(padded).clone()
        got_kv = [c[real].clone() for c in runner.kv_caches]
    eng.scheduler.abort(RuntimeError("test over"))
    for rid in ids:
        eng.pop_finished(rid)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv, strict=True))


@needs_flashinfer
def test_first_decode_step_after_capture_equals_eager():
    """A fresh talker's very first decode step of a new batch size uses replayed (computed) outputs."""
    cfg = medium_config()
    out = {}
    for mode in ("eager", "local_mlp", "full_decode"):
        t = HiggsTalker.from_config(
            cfg, device="cuda", graph_mode=mode, max_num_seqs=8, max_model_len=512, seed=3, decode_kernel="xqa"
        )
        res = t.generate(["first step check", "another"], SamplingParams(temperature=0), max_frames=2)
        out[mode] = [r.rows.tolist() for r in res]
    assert out["local_mlp"] == out["eager"] and out["full_decode"] == out["eager"]


@torch.inference_mode()
@needs_flashinfer
def test_outer_capture_with_local_path_on_runs_eager_inside(talkers):
    """Capturing a whole decode step while the local MLP path is on must not try to replay the local graphs."""
    t = talkers["local_mlp"]
    runner, hook = t.engine.runner, t.engine.graphs.local.post_attention_or_eager
    padding = runner.padding_batch(4)
    inputs = padding.to_device(runner.device)
    scratch = [runner.slots.scratch]
    runner.attn.plan_bucket(padding)
    with runner.slots.preserved(scratch):
        want = runner.forward(inputs, hook).clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), runner.slots.preserved(scratch):  # the warm-up run, all on the side stream
        runner.forward(inputs, hook)
    torch.cuda.current_stream().wait_stream(side)
    with runner.slots.preserved(scratch), torch.cuda.graph(graph):
        out = runner.forward(inputs, hook)  # guard: local graphs are not replayed here
    with runner.slots.preserved(scratch):
        graph.replay()
    assert torch.equal(out, want)


@needs_flashinfer
def test_capture_failure_falls_back_to_eager_with_one_warning(caplog, monkeypatch):
    cfg = medium_config(num_hidden_layers=2)
    ref = HiggsTalker.from_config(
        cfg,
        device="cuda",
        graph_mode="eager",
        max_num_seqs=4,
        max_model_len=512,
        seed=5,
        decode_kernel="xqa",
        buckets=[4],
    )
    want = ref.generate("fault injection", SamplingParams(temperature=0), max_frames=20).rows

    original = FlashInferKernels.silu_and_mul

    def failing(self, x):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("injected capture failure")
        return original(self, x)

    monkeypatch.setattr(FlashInferKernels, "silu_and_mul", failing)
    with caplog.at_level(logging.WARNING):
        t = HiggsTalker.from_config(
            cfg,
            device="cuda",
            graph_mode="local_mlp",
            max_num_seqs=4,
            max_model_len=512,
            seed=5,
            buckets=[4],
            decode_kernel="xqa",
        )
    warnings = [r for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(warnings) == 1
    assert t.engine.graphs.local.failed and not t.engine.graphs.local.buckets
    got = t.generate("fault injection", SamplingParams(temperature=0), max_frames=20).rows
    assert torch.equal(got, want)


@needs_flashinfer
def test_cancel_between_graph_steps_leaves_other_requests_unchanged(talkers):
    t = talkers["full_decode"]
    eng = t.engine
    params = SamplingParams(temperature=0.8, seed=11, max_frames=40)
    prompts = [t.build_prompt(f"cancel test {i}") for i in range(5)]

    def run(cancel: bool) -> list:
        ids = [eng.add_request(p, params) for p in prompts]
        for step in range(200):
            if not eng.has_unfinished():
                break
            eng.step()
            if cancel and step == 10:
                assert eng.cancel(ids[2])
        rows = [torch.stack(eng.pop_finished(i).rows) for i in ids]
        return rows[:2] + rows[3:]

    for want, got in zip(run(False), run(True), strict=True):
        assert torch.equal(want, got)


# --------------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("mode", MODES)
@needs_flashinfer
def test_tiny_nucleus_equals_greedy_on_every_graph_path(talkers, mode):
    """Seeded sampling with a nucleus that keeps only the top code gives exactly the greedy codes, on the
    eager bucket path and inside local MLP and full decode-step graphs (which always run the full sampler)."""
    t = talkers[mode]
    texts = [f"nucleus check {i}" for i in range(6)]
    greedy = t.generate(texts, SamplingParams(temperature=0.0, max_frames=24))
    nucleus = t.generate(texts, [SamplingParams(temperature=1.2, top_p=1e-9, seed=i, max_frames=24) for i in range(6)])
    for g, n in zip(greedy, nucleus, strict=True):
        assert torch.equal(g.rows, n.rows), mode


def test_masked_codes_are_never_sampled_on_cuda(monkeypatch):
    """10^6 draws on the GPU from distributions with two allowed codes out of 1026: none outside the pair, from the
    torch race around the noise kernel and from the race kernel; the hash words equal the CPU's (integer
    arithmetic) and the noise agrees to 2 ulp, extreme words included."""
    from higgs_talker.heads import fused, triton_kernels
    from higgs_talker.heads.sampling import CODE_KEY, exponential_noise, sample_codes

    rows, n, v = 125_000, 8, 1026
    g = torch.Generator(device="cuda").manual_seed(3)
    first = torch.randint(0, v, (rows, n, 1), generator=g, device="cuda")
    second = (first + torch.randint(1, v, (rows, n, 1), generator=g, device="cuda")) % v
    logits = torch.full((rows, n, v), float("-inf"), device="cuda")
    logits.scatter_(2, first, 0.0)
    logits.scatter_(2, second, 1.0)
    ones = torch.ones(rows, device="cuda")
    params = (ones, torch.full((rows,), 50, device="cuda"), ones * 0.99, torch.arange(rows, device="cuda") * 7 + 1,
              torch.arange(rows, device="cuda"))  # fmt: skip
    monkeypatch.setattr(fused, "DISABLED", {"sampler race"})  # the torch race, with the noise kernel
    codes = sample_codes(logits, *params)
    assert ((codes[..., None] == first) | (codes[..., None] == second)).all()
    assert fused.state("sampler noise") != "off"  # more rows than a grid's y axis holds: still the kernel's
    codes = triton_kernels.race_argmax(logits, *params, CODE_KEY, True)  # the kernel itself, unchecked
    assert ((codes[..., None] == first) | (codes[..., None] == second)).all()
    seeds, steps = torch.tensor([0, 7, 7, 0]), torch.tensor([789, 108, 2014, 1993])
    # the hash words are integers (identical); CPU and CUDA log() may each be 1 ulp off: 2 ulp apart at most
    cpu, gpu = exponential_noise(seeds, steps, n, v), exponential_noise(seeds.cuda(), steps.cuda(), n, v).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    assert torch.isfinite(gpu).all() and (gpu > 0).all()


@pytest.mark.parametrize("rows", [1, 64, 4096])
def test_frame_kernels_give_the_reference_values_on_cuda(rows):
    """The Triton frame kernels on the GPU: the noise words, the delay mask and the state update equal their
    torch references, eagerly and (noise) replayed in a CUDA graph; and in a sampled generation the first-use checks
    accepted the race (which draws the noise itself), the mask and the update (or every frame would quietly run the
    references)."""
    from dataclasses import fields

    from higgs_talker.heads import fused, sampling, triton_kernels
    from higgs_talker.heads.delay import DelayState, apply_delay_mask, update_state

    n, c, v = 8 * 1026, 8, 1026
    g = torch.Generator(device="cuda").manual_seed(rows)
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=g, device="cuda")
    steps = torch.randint(0, 2**31 - 1, (rows,), generator=g, device="cuda")
    want = sampling.uniform_from_bits(sampling.noise_words(seeds, steps, n))
    assert torch.equal(triton_kernels.uniform_noise(seeds, steps, n, sampling.CODE_KEY), want)
    graph, out = capture_graph(lambda: triton_kernels.uniform_noise(seeds, steps, n, sampling.CODE_KEY))
    steps.add_(1)
    graph.replay()
    assert torch.equal(out, sampling.uniform_from_bits(sampling.noise_words(seeds, steps, n)))
    state = DelayState(
        last_codes=torch.randint(0, v, (rows, c), generator=g, device="cuda"),
        has_codes=torch.rand(rows, generator=g, device="cuda") < 0.5,
        delay=torch.randint(0, c, (rows,), generator=g, device="cuda"),
        countdown=torch.randint(-1, c, (rows,), generator=g, device="cuda"),
        done=torch.rand(rows, generator=g, device="cuda") < 0.1,
    )
    allowed = torch.rand(rows, generator=g, device="cuda") < 0.5
    logits = torch.randn(rows, c, v, generator=g, device="cuda")
    ref = apply_delay_mask(logits.clone(), state.delay, state.countdown, v - 2, v - 1, allowed)
    assert torch.equal(triton_kernels.delay_mask(logits.clone(), state.delay, state.countdown, v - 2, v - 1, allowed),
                       ref)  # fmt: skip
    codes = torch.where(torch.rand(rows, c, generator=g, device="cuda") < 0.2, v - 1, ref.argmax(-1))
    active = torch.rand(rows, generator=g, device="cuda") < 0.9
    emitted, new = update_state(codes, state, active, v - 2, v - 1)
    got_emitted, got_new = triton_kernels.update_state(codes, state, active, v - 2, v - 1)
    assert torch.equal(got_emitted, emitted)
    assert all(torch.equal(getattr(got_new, f.name), getattr(new, f.name)) for f in fields(DelayState))
    t = HiggsTalker.from_config(medium_config(num_hidden_layers=1), device="cuda", graph_mode="eager", max_num_seqs=4,
                                max_model_len=256)  # fmt: skip
    t.generate("check the kernels", SamplingParams(temperature=1.0, seed=1), max_frames=3)
    names = ("sampler race", "delay mask", "delay state update")  # a sampled step's noise is the race kernel's
    assert {name: fused.state(name) for name in names} == dict.fromkeys(names, "ok")


# --------------------------------------------------------------------------------------------------- no FlashInfer


def test_cuda_without_flashinfer_runs_sdpa_in_every_graph_mode(monkeypatch):
    """FlashInfer absent: attention falls back to torch SDPA and the kernels to torch, every graph mode captures
    over SDPA's bucket buffers, and all modes give the eager codes."""
    import sys

    from higgs_talker.attention import SdpaAttention

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` now raises ImportError
    cfg = medium_config(num_hidden_layers=2)
    texts = ["no flashinfer", "a second request", "third"]
    out = {}
    for mode in MODES:
        t = HiggsTalker.from_config(cfg, device="cuda", graph_mode=mode, max_num_seqs=4, max_model_len=256, seed=2,
                                    buckets=[1, 2, 4])  # fmt: skip
        assert isinstance(t.engine.runner.attn, SdpaAttention) and t.model.kernels.name == "torch"
        if mode == "full_decode":
            assert sorted(t.engine.graphs.full.graphs) == [1, 2, 4] and not t.engine.graphs.full.failed
        if mode == "local_mlp":
            assert sorted(t.engine.graphs.local.buckets) == [1, 2, 4] and not t.engine.graphs.local.failed
        out[mode] = [r.rows for r in t.generate(texts, SamplingParams(temperature=0.0), max_frames=12)]
    for mode in MODES[1:]:
        for a, b in zip(out["eager"], out[mode], strict=True):
            assert torch.equal(a, b), mode


def test_the_tiny_checkpoint_runs_on_cuda_over_sdpa_in_every_graph_mode(tiny_dir):
    """The embedded default's heads are 32 wide, which FlashInfer's FA2 prefill does not serve (flashinfer#4299: an
    illegal memory access): on CUDA it runs the torch kernels and SDPA, every graph mode gives the eager codes, and
    those equal the float32 CPU engine's up to near ties (every row checked against the fp32 reference)."""
    from higgs_talker.attention import SdpaAttention

    texts = ["Hello there.", "A second, longer request.", "Third."]
    params = SamplingParams(temperature=0.0)
    out = {}
    for mode in MODES:
        t = HiggsTalker.from_pretrained(tiny_dir, device="cuda", dtype="float32", graph_mode=mode, max_num_seqs=4,
                                        max_model_len=256, buckets=[1, 2, 4])  # fmt: skip
        assert isinstance(t.engine.runner.attn, SdpaAttention) and t.model.kernels.name == "torch"
        out[mode] = [r.rows for r in t.generate(texts, params, max_frames=12)]
    for mode in MODES[1:]:
        for a, b in zip(out["eager"], out[mode], strict=True):
            assert torch.equal(a, b), mode
    cpu = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=4, max_model_len=256)
    for text, rows in zip(texts, out["eager"], strict=True):
        want = cpu.generate(text, params, max_frames=12).rows
        assert rows.shape == want.shape and (rows.cpu() != want).sum() <= 1, text  # fp32 on both: at most a near tie


@needs_flashinfer
def test_concurrent_callers_on_a_cuda_talker(talkers):
    """Threads sharing one CUDA talker (graphs on): each gets the codes its requests get in one batched call."""
    import threading

    t = talkers["auto"]
    texts = [f"thread {i} says hello" for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_frames=20 + i) for i in range(8)]
    want = [r.rows for r in t.generate(texts, params)]
    got = [None] * 8

    def call(i):
        got[i] = t.generate(texts[i], params[i]).rows

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    from _engine_invariants import check_delay_pattern

    for i in range(8):  # bf16 rounds with the batch's make-up, so a greedy code may flip at a near tie (see CPU)
        assert got[i] is not None and got[i].shape[1] == 8 and got[i].shape[0] <= params[i].max_frames + 8
        check_delay_pattern(got[i], "eoc" if got[i].shape[0] < params[i].max_frames + 8 else "max_frames")
        assert torch.equal(got[i][:1], want[i][:1])  # the prefill row: each caller got its own request's codes


# --------------------------------------------------------------------------------------------------- warm-up


@needs_flashinfer
def test_warmup_loads_generates_and_names_flashinfers_cache(make_checkpoint):
    """``higgs_talker.warmup`` on CUDA: load (graph capture included), one generation, and FlashInfer's own
    cache directory in the report, holding the compiled modules (the suite's earlier tests built most of them)."""
    from pathlib import Path

    from flashinfer.jit import env as fi_env

    import higgs_talker

    ckpt = make_checkpoint(medium_config(num_hidden_layers=2), codec=False)
    report = higgs_talker.warmup(ckpt, "cuda", graph_mode="full_decode", max_model_len=256, max_num_seqs=4)
    assert report.compiled and report.kernels == "flashinfer" and report.device.startswith("cuda")
    assert report.rows >= 2 and report.graph_warmup_s > 0 and report.generate_s > 0
    assert report.caches["flashinfer"] == Path(fi_env.FLASHINFER_CACHE_DIR)
    assert report.modules_after["flashinfer"] >= 1, f"no *.so under {report.caches['flashinfer']}"
    assert str(report.caches["flashinfer"]) in "\n".join(report.lines())


# --------------------------------------------------------------------------------------------------- choice cache


def _cached_talker(cache, **options) -> HiggsTalker:
    """A talker that measures every choice it can (GEMV tiles, decode kernels, auto paths) on choice cache ``cache``."""
    options = {"graph_mode": "auto", "decode_kernel": "auto", "row_gemv": "auto", "buckets": (1, 4, 16), **options}
    return HiggsTalker.from_config(medium_config(), device="cuda", max_num_seqs=16, max_model_len=1024, seed=0,
                                   choice_cache=cache, **options)  # fmt: skip


@needs_flashinfer
def test_a_second_start_on_the_choice_cache_times_nothing_and_gives_the_same_codes(tmp_path, monkeypatch):
    """Two talkers of one shape and options on one choice cache: the first measures and writes the entry; the
    second reads it, checks each choice without timing anything (every timer raises), captures only each bucket's
    cached path, and gives the first one's greedy codes."""
    from higgs_talker.cuda_graphs import kernels as kernels_module
    from higgs_talker.cuda_graphs import runner as runner_module

    first = _cached_talker(tmp_path)
    measured = first.engine.graphs
    assert measured.choices_source == "measured" and measured.choice_file.parent == tmp_path
    assert {"bucket_kernels", "auto_choice"} <= set(measured.choices)

    def no_timing(*args, **kwargs):
        raise AssertionError("a start on cached choices timed something")

    for module in (kernels_module, runner_module):
        monkeypatch.setattr(module, "median_ms", no_timing)
    second = _cached_talker(tmp_path)
    cached = second.engine.graphs
    assert cached.choices_source == "cached" and cached.choices == measured.choices
    assert cached.choice_file == measured.choice_file and not cached.timings
    assert all("step_ms" not in r for r in cached.kernel_timings)
    assert second.model.kernels.row_configs == first.model.kernels.row_configs
    assert second.engine.runner.attn.bucket_kernel == first.engine.runner.attn.bucket_kernel
    assert cached.choice == measured.choice
    for size, path in cached.choice.items():  # only the cached path of each bucket was captured
        assert (size in cached.full.graphs) == (path == "full_decode")
        assert (size in cached.local.buckets) == (path == "local_mlp")
    for batch in (1, 3, 16):
        assert _run_schedule(second, batch) == _run_schedule(first, batch), f"batch {batch}"


@needs_flashinfer
def test_a_cached_decode_kernel_that_fails_its_check_is_measured_again(tmp_path, caplog):
    """An entry naming a decode kernel auto does not allow (as an edited or stale file might): one warning, that
    bucket measured again, the entry rewritten; the next start reads it."""
    import json

    options = {"graph_mode": "full_decode", "row_gemv": "off", "buckets": (1, 4)}
    first = _cached_talker(tmp_path, **options).engine.graphs
    entry = json.loads(first.choice_file.read_text())
    entry["choices"]["bucket_kernels"]["4"] = "fa3"  # not among auto's candidates: fails its check
    first.choice_file.write_text(json.dumps(entry))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = _cached_talker(tmp_path, **options)
    graphs = again.engine.graphs
    cache_warnings = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "choice" in r.getMessage()
    ]
    assert cache_warnings == [
        "choice cache: the cached decode kernels of buckets [4] failed their check; measuring them again"
    ]
    assert graphs.choices_source == "remeasured" and graphs.choices["bucket_kernels"][4] != "fa3"
    assert again.engine.runner.attn.bucket_kernel[1] == first.choices["bucket_kernels"][1]
    stored = json.loads(graphs.choice_file.read_text())["choices"]["bucket_kernels"]
    assert stored == {str(b): k for b, k in graphs.choices["bucket_kernels"].items()}
    assert _cached_talker(tmp_path, **options).engine.graphs.choices_source == "cached"


@needs_flashinfer
def test_warmup_fills_the_choice_cache_and_names_it(make_checkpoint, tmp_path):
    import higgs_talker

    ckpt = make_checkpoint(medium_config(num_hidden_layers=2), codec=False)
    options = dict(graph_mode="auto", max_model_len=256, max_num_seqs=4, choice_cache=tmp_path / "choices")
    report = higgs_talker.warmup(ckpt, "cuda", **options)
    assert report.choices == "measured" and report.choice_file.parent == tmp_path / "choices"
    assert report.choice_file.is_file() and str(tmp_path / "choices") in "\n".join(report.lines())
    assert higgs_talker.warmup(ckpt, "cuda", **options).choices == "cached"

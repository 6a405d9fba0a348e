"""The Triton kernels (``triton_ops``, ``triton_gemv``, the frame's) on CPU under the Triton interpreter: run with
``TRITON_INTERPRET=1`` where triton is installed; skipped otherwise, so CI needs neither.

The interpreter converts fp32 to bf16 by truncation (``triton/runtime/interpreter.py``, ``_convert_float``
without a rounding mode), up to 2 u per rounding where the GPU's ``cvt.rn.bf16.f32`` is within u: the kernel check
counts its two roundings as four here.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter is off (set TRITON_INTERPRET=1 with triton installed)", allow_module_level=True)
pytest.importorskip("triton")

from _qk_rope import FUSED_OPS, check_qk_norm_rope_store  # noqa: E402
from _tolerance import kernel_rel_tol  # noqa: E402

from higgs_talker import HiggsTalker, SamplingParams, triton_attention, triton_gemv, triton_ops  # noqa: E402
from higgs_talker.attention import SdpaAttention, gather_kv  # noqa: E402
from higgs_talker.cuda_graphs.kernels import ROW_LINEARS  # noqa: E402
from higgs_talker.flashinfer_attention import FlashInferAttention  # noqa: E402
from higgs_talker.ops import FlashInferKernels, TorchKernels, rope_cache  # noqa: E402
from higgs_talker.triton_gemv import RowConfig  # noqa: E402


@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_torch_reference_interpreted(dtype, head_dim, n):
    check_qk_norm_rope_store(triton_ops.qk_norm_rope_store, "cpu", dtype, head_dim, n, seed=n, roundings=4,
                             heads=(8, 2))  # fmt: skip


def test_kernel_rejects_what_it_cannot_take():
    qkv, pos = torch.zeros(2, 12 * 48), torch.zeros(2, dtype=torch.long)
    w, cos_sin, rows = torch.ones(48), torch.zeros(16, 48), torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        triton_ops.qk_norm_rope_store(qkv, pos, w, w, 1e-6, cos_sin, torch.zeros(8, 2, 48), rows)
    assert not triton_ops.supports(48) and not triton_ops.supports(512) and triton_ops.supports(128)
    with pytest.raises(ValueError, match="kv_rows must be"):
        triton_ops.qk_norm_rope_store(torch.zeros(2, 12 * 64), pos, torch.ones(64), torch.ones(64), 1e-6,
                                      torch.zeros(16, 64), torch.zeros(8, 2, 64), rows.int())  # fmt: skip


class InterpretedFusion(TorchKernels):
    """The torch kernels with the fused path on: the attention layers call the (interpreted) Triton kernel."""

    fuse_qk_rope = True

    def __init__(self) -> None:
        self.calls = 0

    def can_fuse_qk_rope(self, head_dim: int) -> bool:
        return triton_ops.supports(head_dim)

    def qk_norm_rope_store(self, *args) -> torch.Tensor:
        self.calls += 1
        return triton_ops.qk_norm_rope_store(*args)


class PrewrittenSdpa(SdpaAttention):
    """SDPA over K/V a fused kernel wrote: FlashInfer's destination (the flat cache rows, by its own formula)."""

    def plan(self, batch) -> None:
        super().plan(batch)
        self._rows = FlashInferAttention._kv_rows(self, batch.slot_mapping)

    def kv_destination(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_caches[layer].view(-1, self.num_kv_heads, self.head_dim), self._rows

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        flat, rows = self.kv_destination(layer)
        return self.forward(layer, q, flat[rows[0]], flat[rows[1]])  # SDPA's own write puts back the same rows


def test_fused_attention_path_gives_the_reference_greedy_codes(talker, tiny_dir):
    """The model's fused branch (kernel + kv_destination + attend) through the engine, prefill and decode, in
    fp32: the same greedy codes as the separate torch steps over SDPA."""
    fused = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024)
    kernels = InterpretedFusion()
    fused.model.use_kernels(kernels)
    runner, t = fused.engine.runner, fused.cfg.text
    runner.attn = PrewrittenSdpa(runner.kv_caches, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
                                 runner.max_model_len, runner.scratch_block)  # fmt: skip
    assert_same_greedy_rows(fused, talker, ["the fused path", "and a second, longer request"])
    assert kernels.calls > 0


def assert_same_greedy_rows(got: HiggsTalker, want: HiggsTalker, texts: list[str]) -> None:
    """Two requests batched together, greedy, 20 frames: every row of ``got`` equals ``want``'s."""
    params = SamplingParams(temperature=0.0, max_frames=20)
    for a, b in zip(got.generate(texts, params), want.generate(texts, params), strict=True):
        assert torch.equal(a.rows, b.rows)


# ------------------------------------------------------------------------------------- paged decode attention


def _paged_case(hq: int, hk: int, d: int, block_size: int, lens: list[int], dtype: torch.dtype, seed: int):
    """A cache of random blocks, each request's table a random set of them (shuffled, shared between requests),
    queries; and the float64 reference of decode attention over them."""
    g = torch.Generator().manual_seed(seed)
    blocks = 3 * -(-max(lens) // block_size) + 2
    cache = torch.randn(blocks, 2, block_size, hk, d, generator=g).to(dtype)
    width = -(-max(lens) // block_size) + 1  # a spare column: tables are wider than any context
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lens]).int()
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    want = []
    for i, n in enumerate(lens):
        k, v = gather_kv(cache, tables[i], n)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[i].double()[:, None], k.double().transpose(0, 1), v.double().transpose(0, 1), scale=d**-0.5,
            enable_gqa=True,
        )  # fmt: skip
        want.append(o[:, 0])
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32), torch.stack(want)


# (query heads, KV heads, head_dim, block size, context lengths, multiprocessors the splits aim at)
PAGED_CASES = [
    (8, 2, 64, 16, [37], 64),  # one request, 32 splits of which its context fills 2: the rest return uncounted
    (8, 2, 64, 16, [1, 100, 513], 16),  # a one-token context (one split used) beside long ones, 8 splits
    (4, 4, 32, 8, [300, 17], 4),  # no grouping (one query head a KV head), 2 splits
    (16, 2, 128, 16, [65, 64, 129, 2], 1),  # group of 8, no split
]


@pytest.mark.parametrize(("hq", "hk", "d", "bs", "lens", "programs"), PAGED_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_float64_interpreted(dtype, hq, hk, d, bs, lens, programs):
    """Split over the context and merged by the last split, against float64 attention over the same tables:
    fp32 within 1e-5 (a few roundings over at most 513 tokens), bf16 within 1e-2 (the output and the
    probabilities rounded to bf16 by the interpreter's truncation: up to 2^-7 relative each). Every counter is
    back at zero for the next launch."""
    q, cache, tables, seq_lens, want = _paged_case(hq, hk, d, bs, lens, dtype, seed=len(lens) + hq)
    scratch = triton_attention.DecodeScratch(4, hq, hk, d, programs, torch.device("cpu"))
    got = triton_attention.paged_decode(q, cache, tables, seq_lens, d**-0.5, scratch)
    assert got.dtype == dtype and got.shape == q.shape
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2), err
    assert not scratch.counters.any()
    again = triton_attention.paged_decode(q, cache, tables, seq_lens, d**-0.5, scratch)  # the counters reused
    assert torch.equal(again, got)


@pytest.mark.parametrize(("hq", "hk", "d", "bs", "lens", "programs"), PAGED_CASES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_qkv_matches_float64_interpreted(dtype, hq, hk, d, bs, lens, programs):
    """QK-norm, RoPE and the new token's K/V write inside the attention launch (``paged_decode_qkv``), against
    float64, requests on blocks of their own (as the engine's new tokens are): the reference norms and rotates the
    same qkv rows in float64, writes K/V into a float64 copy of the cache and attends over it. Output within the
    attention test's bounds, the written K within the separate kernel's, V equal to the qkv input, every other
    cache row untouched."""
    g = torch.Generator().manual_seed(d + len(lens))
    b, width = len(lens), -(-max(lens) // bs) + 1
    cache = torch.randn(b * width + 3, 2, bs, hk, d, generator=g).to(dtype)
    # each request's own blocks in random order (a new token's block is never another request's context)
    tables = torch.randperm(cache.shape[0], generator=g)[: b * width].view(b, width).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qkv = torch.randn(b, (hq + 2 * hk) * d + 5, generator=g).to(dtype)[:, 5:]  # strided rows
    positions = torch.randint(0, 4096, (b,), generator=g)
    q_weight, k_weight = (1 + 0.1 * torch.randn(2, d, generator=g)).to(dtype)
    cos_sin = rope_cache(d, 4096, 1e6, "cpu")
    last = torch.tensor(lens) - 1  # each request's new token: the last slot of its context
    k_rows = tables[torch.arange(b), last // bs].long() * 2 * bs + last % bs
    kv_rows = torch.stack([k_rows, k_rows + bs])
    before = cache.clone()
    scratch = triton_attention.DecodeScratch(4, hq, hk, d, programs, torch.device("cpu"))

    got = triton_attention.paged_decode_qkv(qkv, positions, q_weight, k_weight, 1e-6, cos_sin, kv_rows, cache,
                                            tables, seq_lens, d**-0.5, scratch)  # fmt: skip

    ref = before.double()
    q = TorchKernels.qk_norm_rope_store(qkv.double(), positions, q_weight.double(), k_weight.double(), 1e-6,
                                        cos_sin.double(), ref.view(-1, hk, d), kv_rows)  # fmt: skip
    want = torch.stack([
        torch.nn.functional.scaled_dot_product_attention(
            q[i][:, None], *(x.transpose(0, 1) for x in gather_kv(ref, tables[i], n)), scale=d**-0.5, enable_gqa=True,
        )[:, 0]
        for i, n in enumerate(lens)
    ])  # fmt: skip
    err = ((got.double() - want).norm() / want.norm()).item()
    assert got.dtype == dtype and err <= (1e-5 if dtype == torch.float32 else 1e-2), err
    flat, ref_flat = cache.view(-1, hk, d), ref.view(-1, hk, d)
    # K within the separate kernel's bound (tests/_qk_rope.py): rel_tol * (|n_i| + |n_partner|), n the normed head
    normed = TorchKernels.rms_norm(qkv[:, hq * d : (hq + hk) * d].double().reshape(b, hk, d), k_weight.double(),
                                   1e-6).abs()  # fmt: skip
    pair = normed[..., : d // 2] + normed[..., d // 2 :]
    bound = kernel_rel_tol(dtype, 4, [d], FUSED_OPS) * torch.cat([pair, pair], dim=-1)  # 4: truncated roundings
    k_err = (flat[kv_rows[0]].double() - ref_flat[kv_rows[0]]).abs()
    assert (k_err <= bound).all(), (k_err - bound).max().item()
    assert torch.equal(flat[kv_rows[1]], qkv[:, (hq + hk) * d :].reshape(b, hk, d))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[kv_rows.flatten()] = False
    assert torch.equal(flat[untouched], before.view(-1, hk, d)[untouched])
    assert not scratch.counters.any()


def test_split_counts_aim_at_four_programs_a_multiprocessor():
    """132 SMs (an H100), 8 KV heads: 16 requests get 4 splits (512 programs), 64 requests fill the GPU alone."""
    assert [triton_attention.splits_for(b, 8, 132) for b in (1, 2, 4, 8, 16, 32, 64)] == [32, 32, 16, 8, 4, 2, 1]
    assert triton_attention.splits_for(1, 1, 10_000) == triton_attention.MAX_SPLITS


def test_paged_decode_rejects_what_it_cannot_take():
    q, cache, tables, seq_lens, _ = _paged_case(8, 2, 64, 16, [20, 30], torch.float32, seed=0)
    scratch = triton_attention.DecodeScratch(2, 8, 2, 64, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="cache must be a contiguous"):
        triton_attention.paged_decode(q, cache.transpose(0, 1), tables, seq_lens, 0.1, scratch)
    with pytest.raises(ValueError, match="block_tables must be"):
        triton_attention.paged_decode(q, cache, tables[:1], seq_lens, 0.1, scratch)
    with pytest.raises(ValueError, match="seq_lens must be"):
        triton_attention.paged_decode(q, cache, tables, seq_lens[:1], 0.1, scratch)
    with pytest.raises(ValueError, match="scratch sized for 1 requests"):
        triton_attention.paged_decode(q, cache, tables, seq_lens, 0.1,
                                      triton_attention.DecodeScratch(1, 8, 2, 64, 8, torch.device("cpu")))  # fmt: skip
    assert not triton_attention.supports(12, 8, 64) and not triton_attention.supports(64, 2, 64)  # group 1.5, 32
    assert not triton_attention.supports(8, 2, 48) and triton_attention.supports(32, 8, 128)


def test_paged_decode_qkv_rejects_what_it_cannot_take():
    """The qkv path checks its arguments as the separate kernel does (``triton_ops.check_inputs``) and the cache,
    tables and scratch as ``paged_decode`` does; each error names the bad value."""
    _, cache, tables, seq_lens, _ = _paged_case(8, 2, 64, 16, [20, 30], torch.float32, seed=0)
    qkv, positions, w = torch.zeros(2, 12 * 64), torch.zeros(2, dtype=torch.long), torch.ones(64)
    cos_sin, kv_rows = rope_cache(64, 64, 1e6, "cpu"), torch.zeros(2, 2, dtype=torch.long)
    scratch = triton_attention.DecodeScratch(2, 8, 2, 64, 8, torch.device("cpu"))

    def call(**changed):
        args = {"qkv": qkv, "positions": positions, "q_weight": w, "k_weight": w, "eps": 1e-6, "cos_sin": cos_sin,
                "kv_rows": kv_rows, "cache": cache, "block_tables": tables, "seq_lens": seq_lens, "scale": 0.1,
                "scratch": scratch} | changed  # fmt: skip
        return triton_attention.paged_decode_qkv(**args)

    with pytest.raises(ValueError, match="kv_rows must be"):
        call(kv_rows=kv_rows.int())
    with pytest.raises(ValueError, match="k_weight must be a contiguous"):
        call(k_weight=torch.ones(32))
    with pytest.raises(ValueError, match="cos_sin must be"):
        call(cos_sin=cos_sin.double())
    with pytest.raises(ValueError, match="qkv must be"):
        call(qkv=torch.zeros(2, 12 * 64 + 5))
    with pytest.raises(ValueError, match="cache must be a contiguous"):
        call(cache=cache.transpose(0, 1))
    with pytest.raises(ValueError, match="seq_lens must be"):
        call(seq_lens=seq_lens[:1])


class TritonDecodeSdpa(SdpaAttention):
    """SDPA for prefill; every decode step's attention through the (interpreted) Triton kernel over the same
    block tables."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.scratch = triton_attention.DecodeScratch(8, self.num_heads, self.num_kv_heads, self.head_dim, 16,
                                                      self.device)  # fmt: skip
        self.decodes = 0

    def _decode_attention(self, cache, q, d):
        self.decodes += 1
        tables, lens = d.block_tables.int().contiguous(), d.seq_lens.int().contiguous()
        return triton_attention.paged_decode(q, cache, tables, lens, self.scale, self.scratch).reshape(q.shape[0], -1)


def test_triton_decode_attention_gives_the_reference_greedy_codes(talker, tiny_dir):
    """The kernel as the engine's decode attention (eager steps, continuous batching of two requests), fp32:
    the same greedy codes as SDPA."""
    other = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024)
    runner, t = other.engine.runner, other.cfg.text
    runner.attn = backend = TritonDecodeSdpa(runner.kv_caches, t.num_attention_heads, t.num_key_value_heads,
                                             t.head_dim, runner.max_model_len, runner.scratch_block)  # fmt: skip
    assert_same_greedy_rows(other, talker, ["the triton decode", "and a second, longer request"])
    assert backend.decodes > 0


class TritonQkvSdpa(PrewrittenSdpa):
    """Prefill as ``PrewrittenSdpa``; every decode step's QK-norm, RoPE, K/V write and attention in one
    (interpreted) Triton launch from the qkv rows (``paged_decode_qkv``), as ``FlashInferAttention.attend_qkv``."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.scratch = triton_attention.DecodeScratch(8, self.num_heads, self.num_kv_heads, self.head_dim, 16,
                                                      self.device)  # fmt: skip
        self.decodes = 0

    def attend_qkv(self, layer, qkv, positions, q_weight, k_weight, eps, cos_sin):
        if self._decode is None:
            return None
        self.decodes += 1
        d, (_, rows) = self._decode, self.kv_destination(layer)
        return triton_attention.paged_decode_qkv(
            qkv, positions, q_weight, k_weight, eps, cos_sin, rows, self.kv_caches[layer],
            d.block_tables.int().contiguous(), d.seq_lens.int().contiguous(), self.scale, self.scratch,
        ).reshape(qkv.shape[0], -1)  # fmt: skip


def test_attention_from_qkv_rows_gives_the_reference_greedy_codes(talker, tiny_dir):
    """The model's fused branch with a backend whose decode steps take the qkv rows (``attend_qkv``), through the
    engine (prefill, then decode steps of two batched requests), fp32: the same greedy codes as SDPA; the separate
    fused kernel runs only for the prefills."""
    other = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024)
    kernels = InterpretedFusion()
    other.model.use_kernels(kernels)
    runner, t = other.engine.runner, other.cfg.text
    runner.attn = backend = TritonQkvSdpa(runner.kv_caches, t.num_attention_heads, t.num_key_value_heads,
                                          t.head_dim, runner.max_model_len, runner.scratch_block)  # fmt: skip
    assert_same_greedy_rows(other, talker, ["attention from qkv rows", "and a second, longer request"])
    assert backend.decodes > 0 and 0 < kernels.calls < backend.decodes


# ----------------------------------------------------------------------------------------------- one-row GEMV


def _linear_case(dtype: torch.dtype, m: int, n: int, k: int, bias: bool, silu: bool, seed: int):
    """Rows x [m, k], weight w (gate | up with ``silu``), bias b or None, the float64 result and its tolerance (a
    row's relative error)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(2 * n if silu else n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    roundings = 1
    if silu:  # each half rounded as the GEMM stores it, then SiLU-and-mul rounded once more
        gate, up = want.to(dtype).double().chunk(2, dim=-1)
        want, roundings = torch.nn.functional.silu(gate) * up, 3
    # each rounding within 2 u here (the interpreter truncates to bf16), the fp32 sum of k products within k u32
    u = torch.finfo(dtype).eps / 2
    return x, w, b, want, 2 * roundings * u + k * 2.0**-24


SMALL_TILES = [RowConfig(2, 32, 4, 2), RowConfig(1, 64, 2, 2)]  # several programs and K chunks, ragged ends


@pytest.mark.parametrize("tile", SMALL_TILES)
@pytest.mark.parametrize(("n", "k", "bias", "silu"), [(37, 50, True, False), (64, 96, False, False),
                                                      (1, 130, False, False), (37, 50, False, True)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_linear_matches_float64_interpreted(dtype, n, k, bias, silu, tile):
    x, w, b, want, tolerance = _linear_case(dtype, 1, n, k, bias, silu, seed=n * k)
    got = triton_gemv.row_linear(x, w, b, tile, silu_mul=silu)
    assert got.shape == (1, n) and got.dtype == dtype
    assert ((got.double() - want).norm() / want.norm()).item() <= tolerance


def test_row_linear_rejects_what_it_cannot_take():
    x, w = torch.zeros(1, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"one row \[1, K\], got x of shape \(2, 8\)"):
        triton_gemv.row_linear(torch.zeros(2, 8), w)
    with pytest.raises(ValueError, match=r"weight of shape \(4, 6\) does not take x of shape \(1, 8\)"):
        triton_gemv.row_linear(x, torch.zeros(4, 6))
    with pytest.raises(ValueError, match="share a dtype"):
        triton_gemv.row_linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="silu_mul needs an even number of weight rows and no bias, got 3 rows"):
        triton_gemv.row_linear(x, torch.zeros(3, 8), silu_mul=True)
    with pytest.raises(ValueError, match="contiguous"):
        triton_gemv.row_linear(x, torch.zeros(8, 4).t())


FEW_SMALL_TILES = [RowConfig(16, 32, 4, 2), RowConfig(32, 64, 4, 2)]  # several programs and K chunks, ragged ends


@pytest.mark.parametrize("tile", FEW_SMALL_TILES)
@pytest.mark.parametrize(("m", "n", "k", "bias", "silu"), [(16, 37, 50, True, False), (3, 64, 96, False, False),
                                                           (1, 1, 130, False, False), (5, 37, 50, False, True),
                                                           (16, 40, 70, False, True)])  # fmt: skip
# the interpreter multiplies a bf16 tl.dot's raw bits (numpy has no bf16): fp16 stands in for the rounded dtypes
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_few_rows_linear_matches_float64_interpreted(dtype, m, n, k, bias, silu, tile):
    x, w, b, want, tolerance = _linear_case(dtype, m, n, k, bias, silu, seed=m * n * k)
    got = triton_gemv.few_rows_linear(x, w, b, tile, silu_mul=silu)
    assert got.shape == (m, n) and got.dtype == dtype
    for i in range(m):  # row by row: a wrong or missing row fails on its own
        assert ((got[i].double() - want[i]).norm() / want[i].norm()).item() <= tolerance, f"row {i}"


def test_few_rows_linear_rejects_what_it_cannot_take():
    w = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"1 to 16 rows \[M, K\], got x of shape \(17, 8\)"):
        triton_gemv.few_rows_linear(torch.zeros(17, 8), w)
    with pytest.raises(ValueError, match=r"got x of shape \(0, 8\)"):
        triton_gemv.few_rows_linear(torch.zeros(0, 8), w)
    with pytest.raises(ValueError, match=r"weight of shape \(4, 6\) does not take x of shape \(2, 8\)"):
        triton_gemv.few_rows_linear(torch.zeros(2, 8), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="share a dtype"):
        triton_gemv.few_rows_linear(torch.zeros(2, 8), w.bfloat16())
    with pytest.raises(ValueError, match=r"block_n and block_k >= 16, got \(8, 64, 4, 2\)"):
        triton_gemv.few_rows_linear(torch.zeros(2, 8), w, config=RowConfig(8, 64, 4, 2))
    with pytest.raises(ValueError, match="few_rows_linear needs contiguous"):
        triton_gemv.few_rows_linear(torch.zeros(8, 2).t(), w)


class InterpretedRowGemv(TorchKernels):
    """The torch kernels with FlashInfer's linear dispatch: inputs of one row of every linear take the
    (interpreted) Triton GEMV and, with ``few``, inputs of 2 to 16 rows the few-row kernel, as after
    ``choose_row_linears`` chose them everywhere."""

    linear = FlashInferKernels.linear
    gate_up_silu = FlashInferKernels.gate_up_silu
    _triton_linear = FlashInferKernels._triton_linear

    def __init__(self, tile: RowConfig, few: RowConfig | None = None) -> None:
        self._gemv = triton_gemv
        self.row_gemv = True
        self.row_configs = dict.fromkeys(ROW_LINEARS, tile)
        self.few_row_configs = dict.fromkeys(ROW_LINEARS, few) if few is not None else {}


def test_row_gemv_path_gives_the_reference_greedy_codes(talker, tiny_dir, monkeypatch):
    """The model's one-row path (every linear at batch 1 decode, gate_up with SiLU-and-mul) through the engine
    in fp32: the same greedy codes as F.linear; prefills (several rows) keep F.linear."""
    rows = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024)
    rows.model.use_kernels(InterpretedRowGemv(RowConfig(16, 128, 4, 2)))  # down's K of 192 in two chunks
    calls = []
    real = triton_gemv.row_linear

    def counting(x, weight, bias=None, config=None, silu_mul=False):
        calls.append((x.shape[0], weight.shape, silu_mul))
        return real(x, weight, bias, config, silu_mul)

    monkeypatch.setattr(triton_gemv, "row_linear", counting)
    params = SamplingParams(temperature=0.0, max_frames=12)
    for text in ["one row at a time", "a second request, alone"]:  # alone: every decode step is one row
        assert torch.equal(rows.generate(text, params).rows, talker.generate(text, params).rows)
    layers = talker.cfg.text.num_hidden_layers
    assert calls and all(n == 1 for n, _, _ in calls)
    assert sum(silu for _, _, silu in calls) == len(calls) // 4 and len(calls) % (4 * layers) == 0


def test_few_rows_path_gives_the_reference_greedy_codes(talker, tiny_dir, monkeypatch):
    """The model's few-row path (decode steps of two batched requests, and prefills of at most 16 tokens, every
    linear, gate_up with SiLU-and-mul) through the engine in fp32: the same greedy codes as F.linear; one-row
    inputs keep the GEMV, longer prefills F.linear."""
    few = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024)
    few.model.use_kernels(InterpretedRowGemv(RowConfig(16, 128, 4, 2), few=RowConfig(16, 128, 4, 2)))
    calls = []
    real = triton_gemv.few_rows_linear

    def counting(x, weight, bias=None, config=None, silu_mul=False):
        calls.append(x.shape[0])
        return real(x, weight, bias, config, silu_mul)

    monkeypatch.setattr(triton_gemv, "few_rows_linear", counting)
    assert_same_greedy_rows(few, talker, ["two requests", "decoded side by side"])
    assert calls and all(2 <= n <= triton_gemv.FEW_ROWS for n in calls) and 2 in calls


# --------------------------------------------------------------------------------------------------- frame kernels


@pytest.mark.parametrize(("rows", "n"), [(1, 8 * 1026), (3, 30), (5, 1025), (2, 1), (0, 64)])
def test_noise_kernel_gives_the_reference_words_bit_for_bit(rows, n):
    from higgs_talker.heads import sampling, triton_kernels
    from higgs_talker.heads.sampling import noise_words, uniform_from_bits

    g = torch.Generator().manual_seed(rows * 1000 + n)
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=g)
    steps = torch.randint(0, 2**31 - 1, (rows,), generator=g)
    if rows:
        seeds[0], steps[0] = 2**63 - 1, 0  # both halves of the largest seed, the first row
    got = triton_kernels.uniform_noise(seeds, steps, n, sampling.CODE_KEY)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.equal(got, uniform_from_bits(noise_words(seeds, steps, n)))


def test_noise_kernel_rejects_what_it_cannot_take():
    from higgs_talker.heads import triton_kernels
    from higgs_talker.heads.sampling import CODE_KEY as KEY

    with pytest.raises(ValueError, match="seeds and steps must be"):
        triton_kernels.uniform_noise(torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), 8, KEY)
    with pytest.raises(ValueError, match="beyond the 32-bit index"):
        triton_kernels.uniform_noise(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 2**31, KEY)
    assert triton_kernels.noise_supports(8 * 1026, KEY) and not triton_kernels.noise_supports(0, KEY)


def _every_delay_state(n: int, boc: int, eoc: int, v: int, seed: int):
    """One row per reachable (delay, countdown) pair x done x has_codes x active x eoc_allowed, with codes that
    hit BOC, EOC and real codes on random codebooks (delay.py's state space, for C = n)."""
    from higgs_talker.heads.delay import DelayState

    pairs = [(d, -1) for d in range(n)] + [(d, c) for d in range(n) for c in range(n)]
    combos = [(d, c, done, has, act, allow) for d, c in pairs for done in (0, 1) for has in (0, 1)
              for act in (0, 1) for allow in (0, 1)]  # fmt: skip
    b = len(combos)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, v, (b, n), generator=g)
    pick = torch.rand(b, n, generator=g)
    codes = torch.where(pick < 0.15, eoc, torch.where(pick < 0.25, boc, codes))
    t = torch.tensor(combos)
    state = DelayState(
        last_codes=torch.randint(0, v, (b, n), generator=g), has_codes=t[:, 3].bool(), delay=t[:, 0],
        countdown=t[:, 1], done=t[:, 2].bool(),
    )  # fmt: skip
    return codes, state, t[:, 4].bool(), t[:, 5].bool()


@pytest.mark.parametrize(("n", "v"), [(8, 1026), (4, 30), (3, 11)])
def test_delay_kernels_equal_the_reference_on_every_state(n, v):
    from dataclasses import fields

    from higgs_talker.heads import triton_kernels
    from higgs_talker.heads.delay import DelayState, apply_delay_mask, update_state

    boc, eoc = v - 2, v - 1
    codes, state, active, allowed = _every_delay_state(n, boc, eoc, v, seed=n * v)
    logits = torch.randn(codes.shape[0], n, v, generator=torch.Generator().manual_seed(v))
    logits[0, 0, 3] = float("nan")  # copied through where allowed, as masked_fill_ does
    for eoc_allowed in (allowed, None):
        want = apply_delay_mask(logits.clone(), state.delay, state.countdown, boc, eoc, eoc_allowed)
        got = triton_kernels.delay_mask(logits.clone(), state.delay, state.countdown, boc, eoc, eoc_allowed)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    emitted, new = update_state(codes, state, active, boc, eoc)
    got_emitted, got_new = triton_kernels.update_state(codes, state, active, boc, eoc)
    assert torch.equal(got_emitted, emitted)
    for f in fields(DelayState):
        a, b = getattr(got_new, f.name), getattr(new, f.name)
        assert a.dtype == b.dtype and torch.equal(a, b), f.name


def test_update_state_writes_row_major_whatever_its_inputs_layout():
    """Dense but permuted inputs ([C, B] storage viewed as [B, C]): the outputs are still the reference's."""
    from dataclasses import fields, replace

    from higgs_talker.heads import triton_kernels
    from higgs_talker.heads.delay import update_state

    n, v = 8, 1026
    codes, state, active, _ = _every_delay_state(n, v - 2, v - 1, v, seed=3)
    codes, state = codes.t().contiguous().t(), replace(state, last_codes=state.last_codes.t().contiguous().t())
    assert not codes.is_contiguous() and not state.last_codes.is_contiguous()
    emitted, new = update_state(codes, state, active, v - 2, v - 1)
    got_emitted, got_new = triton_kernels.update_state(codes, state, active, v - 2, v - 1)
    assert torch.equal(got_emitted, emitted)
    for f in fields(new):
        assert torch.equal(getattr(got_new, f.name), getattr(new, f.name)), f.name


def test_noise_for_more_requests_than_one_grid_row_of_blocks():
    """Requests ride the grid's second axis, blocks of codes the first: 70 requests x 3 blocks, each row its
    reference's."""
    from higgs_talker.heads import sampling, triton_kernels

    seeds, steps = torch.arange(70, dtype=torch.long) * 977, torch.arange(70, dtype=torch.long) % 5
    n = 2 * triton_kernels.BLOCK + 17
    want = sampling.uniform_from_bits(sampling.noise_words(seeds, steps, n))
    assert torch.equal(triton_kernels.uniform_noise(seeds, steps, n, sampling.CODE_KEY), want)


def test_sampled_generation_through_the_frame_kernels_equals_the_reference(talker, monkeypatch):
    """The engine's frames through the (interpreted) noise, mask and update kernels on CPU: the same rows, with
    every kernel checked and in use."""
    from higgs_talker.heads import fused

    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=5, max_frames=16)
    texts = ["frame kernels", "and a second request"]
    want = [r.rows for r in talker.generate(texts, params)]
    monkeypatch.setattr(fused, "_on_kernel_device", lambda t: True)
    monkeypatch.setattr(fused, "stream_is_capturing", lambda: False)
    monkeypatch.setattr(fused, "_state", {})
    monkeypatch.setattr(fused, "_checked", {})
    monkeypatch.setattr(fused, "DISABLED", {"sampler race"})  # its interpreted sort of 2048 keys takes ~1 s a row
    got = [r.rows for r in talker.generate(texts, params)]
    names = ("sampler noise", "delay mask", "delay state update")
    assert {name: fused.state(name) for name in names} == dict.fromkeys(names, "ok")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def _race_inputs(rows: int, n: int, v: int, seed: int, dtype=torch.float32, ties: bool = False):
    """Logits [rows, n, v] and one request's parameters per row that reach every branch of the race: greedy,
    a temperature so small that x / T overflows (the argmax), top-k off / 1 / 3 / past V, top-p off / 0.5 / 0.9 /
    1e-9 / NaN, masked codes, a row with every code masked, and (``ties``) logits on a coarse grid with -0.0 and 0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, v, generator=g) * 4
    if ties:
        x = (x / 2).round()
        x[..., 1::4] = torch.where(x[..., 1::4] == 0, -0.0, x[..., 1::4])  # -0.0 beside 0.0
    x[..., v // 2 :: 5] = float("-inf")  # masked codes, as the delay mask leaves them
    x[0, -1] = float("-inf")  # a codebook with every code masked
    temperature = torch.tensor([0.0, 1.0, 0.7, 1e-38, 1.3, 1.0, 0.5, 2.0])[torch.arange(rows) % 8]
    x[3 % rows] *= 1e3  # with T = 1e-38, finite logits overflow
    top_k = torch.tensor([0, 50, 1, 3, v + 7, 0, 3, 2])[torch.arange(rows) % 8]
    # 1e-9: 1 - p rounds to 1.0, where every code's mass-up-to is at most 1 - p, yet the most likely one stays
    top_p = torch.tensor([1.0, 0.95, 0.5, float("nan"), 0.9, 1e-9, 1.0, 0.3])[torch.arange(rows) % 8]
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=g)
    steps = torch.randint(0, 2**31 - 1, (rows,), generator=g)
    return x.to(dtype), temperature, top_k, top_p, seeds, steps


@pytest.mark.parametrize("filter", [True, False])
@pytest.mark.parametrize(("rows", "n", "v", "dtype", "ties"), [(8, 3, 37, torch.float32, False),
                         (8, 2, 64, torch.float32, True), (5, 4, 100, torch.bfloat16, True),
                         (1, 1, 2, torch.float32, False)])  # fmt: skip
def test_race_kernel_gives_the_reference_codes(rows, n, v, dtype, ties, filter):
    """``race_argmax`` against ``race_scores(...).argmax`` (torch): the same codes, row for row, on every branch."""
    from higgs_talker.heads import sampling, triton_kernels

    args = _race_inputs(rows, n, v, seed=rows * 100 + v, dtype=dtype, ties=ties)
    want = sampling.race_scores(*args, filter=filter).argmax(dim=-1)
    got = triton_kernels.race_argmax(*args, sampling.CODE_KEY, filter=filter)
    assert got.dtype == torch.long and torch.equal(got, want)


def test_race_kernel_takes_strided_logits_and_the_deploy_shape():
    """Every other codebook of a [B, 2C, V] tensor (rows apart in memory), and one request at the 4B head's
    V = 1026 with the deploy sampling."""
    from higgs_talker.heads import sampling, triton_kernels

    x, *rest = _race_inputs(3, 6, 40, seed=7)
    args = (x[:, ::2], *rest)
    assert torch.equal(triton_kernels.race_argmax(*args, sampling.CODE_KEY),
                       sampling.race_scores(*args).argmax(dim=-1))  # fmt: skip
    g = torch.Generator().manual_seed(8)
    deploy = (torch.randn(1, 8, 1026, generator=g) * 3, torch.ones(1), torch.full((1,), 50), torch.full((1,), 0.95),
              torch.tensor([12345]), torch.tensor([67]))  # fmt: skip
    assert torch.equal(triton_kernels.race_argmax(*deploy, sampling.CODE_KEY),
                       sampling.race_scores(*deploy).argmax(dim=-1))  # fmt: skip


def test_race_kernel_sorts_only_the_top_k_candidates_or_the_whole_row():
    """A row whose top-k keeps at most ``RACE_CANDIDATES`` codes sorts only those; the same codes as the reference
    where every logit is negative (an empty candidate slot must rank below all of them), and where more codes tie
    at the k-th value than that (the whole row sorted)."""
    from higgs_talker.heads import sampling, triton_kernels

    g = torch.Generator().manual_seed(9)
    rows, v = 16, 300
    x = torch.randn(rows, 2, v, generator=g) * 3 - 40  # every logit negative
    x[8:, :, :100] = -1.5  # rows 8-15: 100 codes tie at the top, past the 64 candidates for top-k 50
    t = torch.full((rows,), 1.0)
    k = torch.tensor([50, 1, 64, 63, 2, 50, 10, 50] * 2)
    p = torch.tensor([0.95, 1.0, 0.9, 0.5, 1.0, 0.99, 0.8, 1.0] * 2)
    seeds, steps = torch.arange(rows) * 7919 + 3, torch.arange(rows) + 11
    args = (x, t, k, p, seeds, steps)
    assert torch.equal(triton_kernels.race_argmax(*args, sampling.CODE_KEY), sampling.race_scores(*args).argmax(dim=-1))


def test_race_kernel_rejects_what_it_cannot_take():
    from higgs_talker.heads import sampling, triton_kernels

    x, t, k, p, seeds, steps = _race_inputs(2, 2, 16, seed=1)
    with pytest.raises(ValueError, match="the race kernel takes"):
        triton_kernels.race_argmax(x, t.double(), k, p, seeds, steps, sampling.CODE_KEY)
    with pytest.raises(ValueError, match="the race kernel takes"):
        triton_kernels.race_argmax(x.transpose(1, 2), t, k, p, seeds, steps, sampling.CODE_KEY)
    assert not triton_kernels.race_supports(torch.zeros(1, 1, 10_000), t[:1], k[:1], p[:1], seeds[:1], steps[:1],
                                            sampling.CODE_KEY)  # fmt: skip


def test_sample_codes_runs_the_race_kernel_once_it_matched(monkeypatch):
    """``sample_codes`` through ``fused.run_checked`` (the race is on by default): the first call of
    a signature runs both and compares, then the kernel alone; in ``DISABLED``, the reference."""
    from higgs_talker.heads import fused, sampling, triton_kernels

    monkeypatch.setattr(fused, "_on_kernel_device", lambda t: True)
    monkeypatch.setattr(fused, "stream_is_capturing", lambda: False)
    monkeypatch.setattr(fused, "_state", {})
    monkeypatch.setattr(fused, "_checked", {})
    assert "sampler race" not in fused.DISABLED  # on by default (faster on an H100, 2026-12-06)
    args = _race_inputs(4, 3, 33, seed=3)
    want = sampling.race_scores(*args).argmax(dim=-1)
    calls = []
    race = triton_kernels.race_argmax
    monkeypatch.setattr(triton_kernels, "race_argmax", lambda *a, **kw: calls.append(1) or race(*a, **kw))
    assert torch.equal(sampling.sample_codes(*args), want) and fused.state("sampler race") == "ok"
    assert torch.equal(sampling.sample_codes(*args), want) and len(calls) == 2
    monkeypatch.setattr(fused, "DISABLED", {"sampler race"})
    assert torch.equal(sampling.sample_codes(*args), want) and len(calls) == 2


def test_a_call_the_kernels_do_not_take_runs_the_reference_and_leaves_them_untried(monkeypatch):
    """``run_checked``'s ``supported``: a codebook of 70,000 codes (the race sorts at most RACE_MAX_VOCAB in one
    block, the mask holds at most MASK_MAX_VOCAB) goes to the torch references, and neither kernel is tried (tried,
    each would raise and turn itself off)."""
    from higgs_talker.heads import fused, sampling, slots
    from higgs_talker.heads.delay import DelayState, apply_delay_mask

    monkeypatch.setattr(fused, "_on_kernel_device", lambda t: True)
    monkeypatch.setattr(fused, "stream_is_capturing", lambda: False)
    monkeypatch.setattr(fused, "_state", {})
    monkeypatch.setattr(fused, "_checked", {})
    monkeypatch.setattr(fused, "DISABLED", set())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 1, 70_000, generator=g)
    rest = (torch.ones(2), torch.tensor([50, 0]), torch.tensor([0.95, 1.0]), torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert torch.equal(sampling.sample_codes(x, *rest), sampling.race_scores(x, *rest).argmax(dim=-1))
    state = DelayState(last_codes=torch.zeros(2, 1, dtype=torch.long), has_codes=torch.zeros(2, dtype=torch.bool),
                       delay=torch.tensor([0, 1]), countdown=torch.tensor([-1, -1]),
                       done=torch.zeros(2, dtype=torch.bool))  # fmt: skip
    allowed = torch.ones(2, dtype=torch.bool)
    want = apply_delay_mask(x.clone(), state.delay, state.countdown, 30, 31, allowed)
    slots.masked_logits(x, state, 30, 31, allowed)
    assert torch.equal(x, want)
    assert (fused.state("sampler race"), fused.state("delay mask")) == ("untried", "untried")


@pytest.fixture
def row_tiles(monkeypatch):
    """``row_linear_op.TILES`` for a [37, 50] float32 weight (one row and few rows), emptied after the test; and the
    calls each Triton kernel got."""
    from higgs_talker import row_linear_op

    calls = {"row_linear": 0, "few_rows_linear": 0}
    for name in calls:
        kernel = getattr(triton_gemv, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(triton_gemv, name, counted)
    monkeypatch.setattr(row_linear_op, "TILES", {(37, 50, False, torch.float32): tuple(SMALL_TILES[0]),
                                                 (37, 50, True, torch.float32): tuple(FEW_SMALL_TILES[0])})  # fmt: skip
    return calls


def _op_matches_float64(op, m: int, seed: int) -> None:
    x, w, _, want, tolerance = _linear_case(torch.float32, m, 37, 50, False, False, seed=seed)
    got = op(x, w)
    assert got.shape == (m, 37)
    for i in range(m):
        assert ((got[i].double() - want[i]).norm() / want[i].norm()).item() <= tolerance, f"row {i} of {m}"


def test_rows_linear_op_takes_the_kernel_of_its_rows_interpreted(row_tiles):
    """One row takes row_linear, 2-16 rows few_rows_linear, 17 rows, an unmeasured shape and a dtype the tiles were
    not measured for F.linear; each result within the fp32 bound of the float64 product."""
    from higgs_talker import row_linear_op

    assert row_linear_op.FEW_ROWS == triton_gemv.FEW_ROWS
    op = torch.ops.higgs_talker.rows_linear
    for m, row, few in ((1, 1, 0), (2, 1, 1), (16, 1, 2), (17, 1, 2)):  # calls so far of each kernel after m rows
        _op_matches_float64(op, m, seed=m)
        assert row_tiles == {"row_linear": row, "few_rows_linear": few}, m
    x, w = torch.randn(2, 50), torch.randn(36, 50)  # no tile for [36, 50]: F.linear, bit for bit
    assert torch.equal(op(x, w), torch.nn.functional.linear(x, w)) and row_tiles["few_rows_linear"] == 2
    x, w = torch.randn(1, 50).double(), torch.randn(37, 50).double()  # the measured shape, not the measured dtype
    assert torch.equal(op(x, w), torch.nn.functional.linear(x, w)) and row_tiles["row_linear"] == 1


def test_rows_linear_op_decides_per_call_under_torch_compile(row_tiles):
    """Traced once by Dynamo (fullgraph, dynamic rows, no guard on them), the op still takes each call's kernel."""
    op = torch.ops.higgs_talker.rows_linear
    compiled = torch.compile(lambda x, w: op(x, w), fullgraph=True, dynamic=True, backend="aot_eager")
    for m in (1, 5, 17, 1):
        _op_matches_float64(compiled, m, seed=100 + m)
    assert row_tiles == {"row_linear": 2, "few_rows_linear": 1}


def test_use_rows_linear_switches_unquantized_linears_without_bias():
    """A layer's linears whose method is an unquantized one without a bias call the op; one with a bias keeps its
    own apply (the op takes no bias)."""
    from types import SimpleNamespace

    from higgs_talker import row_linear_op

    class UnquantizedLinearMethod:  # the name vLLM's unquantized method has
        def apply(self, layer, x, bias=None):
            return torch.nn.functional.linear(x, layer.weight, bias) + 1000  # tells its own path apart

    def linear(bias: bool):
        return SimpleNamespace(weight=torch.randn(37, 50), bias=torch.randn(37) if bias else None,
                               quant_method=UnquantizedLinearMethod())  # fmt: skip

    layer = SimpleNamespace(self_attn=SimpleNamespace(qkv_proj=linear(True), o_proj=linear(False)),
                            mlp=SimpleNamespace(gate_up_proj=linear(False), down_proj=linear(False)))  # fmt: skip
    assert row_linear_op.use_rows_linear([layer]) == 3
    x = torch.randn(2, 50)
    for module in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(module.quant_method, UnquantizedLinearMethod)
        assert torch.equal(module.quant_method.apply(module, x), torch.nn.functional.linear(x, module.weight))
    qkv = layer.self_attn.qkv_proj
    assert type(qkv.quant_method) is UnquantizedLinearMethod
    own = torch.nn.functional.linear(x, qkv.weight, qkv.bias) + 1000
    assert torch.equal(qkv.quant_method.apply(qkv, x, qkv.bias), own)


def test_choose_tiles_records_each_linears_checked_tile_by_shape_and_dtype(row_tiles, monkeypatch):
    """``row_linear_op.choose_tiles`` on fp16 layers (the interpreter's tensor-core dots misread bf16) with
    ``row_gemv`` on (the first tile that passes its float64 check; timing needs CUDA graphs): every linear's one-row
    and few-row tile lands in ``TILES`` under its weight's (N, K, few, dtype), and the op then takes them."""
    from types import SimpleNamespace

    from higgs_talker import row_linear_op

    monkeypatch.setattr(row_linear_op, "TILES", {})
    monkeypatch.setattr(row_linear_op._OwnPath, "row_gemv", "on")
    monkeypatch.setattr(triton_gemv, "CONFIGS", tuple(SMALL_TILES))
    monkeypatch.setattr(triton_gemv, "FEW_ROW_CONFIGS", tuple(FEW_SMALL_TILES))
    gen = torch.Generator().manual_seed(0)
    shapes = {"qkv": (48, 32), "o_proj": (32, 40), "gate_up": (64, 32), "down": (32, 24)}

    def linear(name):
        return SimpleNamespace(weight=torch.randn(*shapes[name], generator=gen).half(), bias=None)

    layers = [SimpleNamespace(self_attn=SimpleNamespace(qkv_proj=linear("qkv"), o_proj=linear("o_proj")),
                              mlp=SimpleNamespace(gate_up_proj=linear("gate_up"), down_proj=linear("down")))
              for _ in range(2)]  # fmt: skip
    rows = row_linear_op.choose_tiles(layers)
    assert [(r["linear"], r["rows"]) for r in rows] == [(n, m) for m in (1, 16) for n in shapes]
    assert all(r["chosen"] != "torch" for r in rows), rows
    want = {(n, k, few, torch.float16) for n, k in shapes.values() for few in (False, True)}
    assert set(row_linear_op.TILES) == want
    w = layers[0].mlp.down_proj.weight
    x = torch.randn(1, w.shape[1], generator=gen).half()
    calls = dict(row_tiles)
    got = torch.ops.higgs_talker.rows_linear(x, w)
    assert row_tiles["row_linear"] == calls["row_linear"] + 1
    want_row = x.double() @ w.double().T
    assert ((got.double() - want_row).norm() / want_row.norm()).item() <= torch.finfo(torch.float16).eps

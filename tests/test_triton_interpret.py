"""The fused Triton kernel (``triton_ops``) on CPU under the Triton interpreter: run with ``TRITON_INTERPRET=1``
where triton is installed; skipped otherwise, so CI needs neither.

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

from _qk_rope import check_qk_norm_rope_store  # noqa: E402

from higgs_talker import HiggsTalker, SamplingParams, triton_ops  # noqa: E402
from higgs_talker.attention import SdpaAttention  # noqa: E402
from higgs_talker.flashinfer_attention import FlashInferAttention  # noqa: E402
from higgs_talker.ops import TorchKernels  # noqa: E402


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
    texts = ["the fused path", "and a second, longer request"]
    params = SamplingParams(temperature=0.0, max_frames=20)
    want = [r.rows for r in talker.generate(texts, params)]
    got = [r.rows for r in fused.generate(texts, params)]
    assert kernels.calls > 0
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------- noise


@pytest.mark.parametrize(("rows", "n"), [(1, 8 * 1026), (3, 30), (5, 1025), (2, 1), (0, 64)])
def test_noise_kernel_gives_the_reference_words_bit_for_bit(rows, n):
    from higgs_talker.heads import noise_triton
    from higgs_talker.heads.sampling import noise_words, uniform_from_bits

    g = torch.Generator().manual_seed(rows * 1000 + n)
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=g)
    steps = torch.randint(0, 2**31 - 1, (rows,), generator=g)
    if rows:
        seeds[0], steps[0] = 2**63 - 1, 0  # both halves of the largest seed, the first row
    got = noise_triton.uniform_noise(seeds, steps, n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.equal(got, uniform_from_bits(noise_words(seeds, steps, n)))


def test_noise_kernel_rejects_what_it_cannot_take():
    from higgs_talker.heads import noise_triton

    with pytest.raises(ValueError, match="seeds and steps must be"):
        noise_triton.uniform_noise(torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="beyond the 32-bit index"):
        noise_triton.uniform_noise(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 2**31)
    assert noise_triton.supports(8 * 1026) and not noise_triton.supports(0)


def test_sampled_generation_with_the_fused_noise_equals_the_reference(talker, tiny_dir, monkeypatch):
    """The engine's sampler through the (interpreted) fused noise on CPU: the same sampled rows."""
    from higgs_talker.heads import sampling

    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=5, max_frames=16)
    want = [r.rows for r in talker.generate(["fused noise", "a second request"], params)]
    monkeypatch.setattr(sampling, "_on_kernel_device", lambda t: True)
    monkeypatch.setattr(sampling, "_capturing", lambda: False)
    monkeypatch.setattr(sampling, "_fused_state", "untried")
    monkeypatch.setattr(sampling, "_fused", None)
    got = [r.rows for r in talker.generate(["fused noise", "a second request"], params)]
    assert sampling._fused_state == "ok"
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)

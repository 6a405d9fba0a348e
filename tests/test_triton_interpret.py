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

from higgs_talker import triton_ops  # noqa: E402


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

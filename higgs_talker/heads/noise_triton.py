"""The sampler's noise words as one Triton kernel: ``uniform_from_bits(noise_words(seeds, steps, n))``.

In torch the counter-based hash is about 120 elementwise launches a step (three rounds of a 32-bit finaliser
per request, two per code, each round nine operations, each multiplication split in six so that int64 never
overflows), and a full-decode graph runs them at every step. Here one launch over (request, block of codes)
does the same integer operations in registers, in the same int64 arithmetic (so the words are equal bit for
bit, not merely close), and stores the uniform float32 value the torch path makes of each word; the two
``log``\\ s after it stay in torch.

This module needs triton; ``heads.sampling`` imports it only on CUDA. Under ``TRITON_INTERPRET=1`` the kernel
runs on CPU tensors (tests).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .sampling import CODE_KEY

BLOCK = 1024


@triton.jit
def _mul32(x, M_LO: tl.constexpr, M_HI: tl.constexpr):
    # (x * m) mod 2**32 for x in [0, 2**32), m = M_HI * 2**16 + M_LO, in int64 without overflow
    return (x * M_LO + (((x * M_HI) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    # sampling._mix32: xorshift-multiply finaliser of a 32-bit word held in int64
    x = x ^ (x >> 16)
    x = _mul32(x, 0x352D, 0x7FEB)  # 0x7FEB352D
    x = x ^ (x >> 15)
    x = _mul32(x, 0xA68B, 0x846C)  # 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _uniform_noise_kernel(seeds_ptr, steps_ptr, out_ptr, n, BLOCK: tl.constexpr, CODE_KEY: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    step = tl.load(steps_ptr + row).to(tl.int64)
    h = _mix32(seed & 0xFFFFFFFF)
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF))
    h = _mix32(h ^ (step & 0xFFFFFFFF))
    idx = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    bits = _mix32(h ^ _mix32(idx + CODE_KEY))
    bits = _mix32(bits ^ h)
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # the top 23 bits: exact in fp32
    tl.store(out_ptr + row.to(tl.int64) * n + idx, u, mask=idx < n)


def supports(n: int) -> bool:
    """Whether the kernel equals the torch hash for ``n`` codes per row: every index plus ``CODE_KEY`` must stay
    a 32-bit word (true for any real codebook table: the limit is about 1.6e9 codes)."""
    return n > 0 and n - 1 + CODE_KEY < 2**32


def uniform_noise(seeds: Tensor, steps: Tensor, n: int) -> Tensor:
    """seeds, steps [B] int64 -> uniform fp32 [B, n] in (0, 1): ``sampling.uniform_from_bits`` of
    ``sampling.noise_words``, bit for bit."""
    if seeds.dim() != 1 or steps.shape != seeds.shape or seeds.dtype != torch.long or steps.dtype != torch.long:
        raise ValueError(
            f"seeds and steps must be [B] int64 alike, got {tuple(seeds.shape)} {seeds.dtype} and "
            f"{tuple(steps.shape)} {steps.dtype}"
        )
    if not supports(n):
        raise ValueError(f"{n} codes per row is beyond the 32-bit index of the noise hash")
    out = torch.empty(seeds.shape[0], n, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        grid = (seeds.shape[0], triton.cdiv(n, BLOCK))
        _uniform_noise_kernel[grid](seeds.contiguous(), steps.contiguous(), out, n, BLOCK=BLOCK, CODE_KEY=CODE_KEY)
    return out

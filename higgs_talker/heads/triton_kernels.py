"""The frame's per-step work as three Triton kernels (``heads.fused`` decides where they run).

- ``uniform_noise``: the sampler's noise words, ``sampling.uniform_from_bits(sampling.noise_words(...))``. In
  torch the counter-based hash is about 120 elementwise launches (three rounds of a 32-bit finaliser per
  request, two per code, each round nine operations, each multiplication split in six so that int64 never
  overflows); here one launch over (request, block of codes) does the same int64 operations in registers and
  stores the uniform float32 value of each word. The two ``log``\\ s after it stay in torch.
- ``delay_mask``: ``delay.apply_delay_mask`` in place, one program per (request, codebook) row.
- ``update_state``: ``delay.update_state``, one program per request.

Each computes exactly what its reference computes (integer and boolean operations, and float values copied or
replaced by -inf), so the results are equal, not close. This module needs triton; under ``TRITON_INTERPRET=1``
the kernels run on CPU tensors (tests).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .delay import DelayState
from .fused import MASK_MAX_VOCAB, RACE_MAX_VOCAB, delay_mask_supports, noise_supports, race_supports

BLOCK = 1024
# a sampled row whose top-k (with ties) keeps at most this many codes sorts only those (64 keys instead of a
# power of two past V: 2,048 at the 4B head's 1,026 codes); past it, or with top-k off, the race sorts the whole row
RACE_CANDIDATES = 64


@triton.jit
def _mul32(x, M_LO: tl.constexpr, M_HI: tl.constexpr):
    # (x * m) mod 2**32 for x in [0, 2**32), m = M_HI * 2**16 + M_LO, in int64 without overflow
    return (x * M_LO + (((x * M_HI) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    # sampling._mix32 (there on int32 bit patterns): xorshift-multiply finaliser of a 32-bit word held in int64
    x = x ^ (x >> 16)
    x = _mul32(x, 0x352D, 0x7FEB)  # 0x7FEB352D
    x = x ^ (x >> 15)
    x = _mul32(x, 0xA68B, 0x846C)  # 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _noise_uniform(seed, step, idx, CODE_KEY: tl.constexpr):
    # the uniform value in (0, 1) of the noise word of code index ``idx`` (int64) under (seed, step)
    h = _mix32(seed & 0xFFFFFFFF)
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF))
    h = _mix32(h ^ (step & 0xFFFFFFFF))
    bits = _mix32(h ^ _mix32(idx + CODE_KEY))
    bits = _mix32(bits ^ h)
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # the top 23 bits: exact in fp32


@triton.jit
def _uniform_noise_kernel(seeds_ptr, steps_ptr, out_ptr, n, n_blocks, BLOCK: tl.constexpr, CODE_KEY: tl.constexpr):
    # a 1-D grid of rows x blocks of codes (a 2-D grid's y axis would cap the rows at 65535)
    pid = tl.program_id(0).to(tl.int64)
    row, block = pid // n_blocks, pid % n_blocks
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    step = tl.load(steps_ptr + row).to(tl.int64)
    idx = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    tl.store(out_ptr + row * n + idx, _noise_uniform(seed, step, idx, CODE_KEY), mask=idx < n)


def uniform_noise(seeds: Tensor, steps: Tensor, n: int, code_key: int) -> Tensor:
    """seeds, steps [B] int64 -> uniform fp32 [B, n] in (0, 1): ``sampling.uniform_from_bits`` of
    ``sampling.noise_words``, bit for bit (``code_key``: ``sampling.CODE_KEY``)."""
    if seeds.dim() != 1 or steps.shape != seeds.shape or seeds.dtype != torch.long or steps.dtype != torch.long:
        raise ValueError(
            f"seeds and steps must be [B] int64 alike, got {tuple(seeds.shape)} {seeds.dtype} and "
            f"{tuple(steps.shape)} {steps.dtype}"
        )
    if not noise_supports(n, code_key):
        raise ValueError(f"{n} codes per row is beyond the 32-bit index of the noise hash")
    out = torch.empty(seeds.shape[0], n, dtype=torch.float32, device=seeds.device)
    n_blocks = triton.cdiv(n, BLOCK)
    if seeds.shape[0]:
        _uniform_noise_kernel[(seeds.shape[0] * n_blocks,)](
            seeds.contiguous(), steps.contiguous(), out, n, n_blocks, BLOCK=BLOCK, CODE_KEY=code_key
        )
    return out


# --------------------------------------------------------------------------------------------------- delay mask


@triton.jit
def _delay_mask_kernel(
    logits_ptr, stride_b, stride_c, delay_ptr, countdown_ptr, allowed_ptr, V,
    BOC: tl.constexpr, EOC: tl.constexpr, C: tl.constexpr, HAS_ALLOWED: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // C
    q = pid % C
    delay = tl.load(delay_ptr + b)
    countdown = tl.load(countdown_ptr + b)
    started = q < tl.minimum(delay + 1, C)
    ramp = countdown >= 0
    locked = ramp & (q < C - countdown)
    eoc_free = started & (countdown < 0) & (q == 0)
    if HAS_ALLOWED:
        eoc_free = eoc_free & (tl.load(allowed_ptr + b) != 0)
    force = tl.where(started, tl.where(locked, EOC, -1), BOC)  # -1: not forced
    v = tl.arange(0, BLOCK_V)
    row = logits_ptr + b.to(tl.int64) * stride_b + q.to(tl.int64) * stride_c
    x = tl.load(row + v, mask=v < V)
    free = (v != BOC) & ((v != EOC) | eoc_free)
    allowed = tl.where(force >= 0, v == force, free)
    tl.store(row + v, tl.where(allowed, x, float("-inf")), mask=v < V)


def delay_mask(
    logits: Tensor, delay: Tensor, countdown: Tensor, boc_id: int, eoc_id: int, eoc_allowed: Tensor | None = None
) -> Tensor:
    """``delay.apply_delay_mask`` (same arguments, in place on ``logits``, which it returns)."""
    if not delay_mask_supports(logits):
        raise ValueError(f"logits must be [B, C, V] fp16/bf16/fp32/fp64 rows that do not overlap, unit stride "
                         f"along V, V <= {MASK_MAX_VOCAB}; got {tuple(logits.shape)} {logits.dtype}, strides "
                         f"{logits.stride()}")  # fmt: skip
    b, n, v = logits.shape
    if b:
        allowed = eoc_allowed if eoc_allowed is not None else delay  # a placeholder pointer, never read
        _delay_mask_kernel[(b * n,)](
            logits, logits.stride(0), logits.stride(1), delay.contiguous(), countdown.contiguous(),
            allowed.contiguous(), v, BOC=boc_id, EOC=eoc_id, C=n, HAS_ALLOWED=eoc_allowed is not None,
            BLOCK_V=triton.next_power_of_2(v),
        )  # fmt: skip
    return logits


# --------------------------------------------------------------------------------------------------- state update


@triton.jit
def _update_state_kernel(
    codes_ptr, last_ptr, has_ptr, delay_ptr, countdown_ptr, done_ptr, active_ptr,
    emit_out, last_out, has_out, delay_out, countdown_out, done_out,
    BOC: tl.constexpr, EOC: tl.constexpr, C: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    q = tl.arange(0, CP)
    inside = q < C
    codes = tl.load(codes_ptr + b * C + q, mask=inside, other=0)
    last_codes = tl.load(last_ptr + b * C + q, mask=inside, other=0)
    has_codes = tl.load(has_ptr + b)
    delay = tl.load(delay_ptr + b)
    countdown = tl.load(countdown_ptr + b)
    was_done = tl.load(done_ptr + b)
    a = tl.load(active_ptr + b) != 0
    ramp = countdown >= 0
    # 1. ramp-up: codebooks that have not started are BOC
    ramping_up = delay + 1 < C
    codes = tl.where(ramping_up & (q > delay), BOC, codes)
    new_delay = tl.where(ramping_up, delay + 1, delay)
    # 2. ramp-down lock
    codes = tl.where(ramp & (q < C - countdown), EOC, codes)
    # 3. a new EOC on a normal row: every codebook up to the last EOC one becomes EOC
    is_eoc = (codes == EOC) & (countdown < 0) & inside
    last = tl.max(tl.where(is_eoc, q, -1), axis=0)
    codes = tl.where(q <= last, EOC, codes)
    new_countdown = tl.where(ramp, countdown - 1, tl.where(last >= 0, C - last - 1, -1).to(countdown.dtype))
    # 4. the terminal row
    done = (new_countdown == 0) & a
    new_delay = tl.where(done, 0, new_delay)
    new_countdown = tl.where(done, -1, new_countdown)
    tl.store(emit_out + b * C + q, tl.where(a, codes, -1), mask=inside)
    tl.store(last_out + b * C + q, tl.where(a, codes, last_codes), mask=inside)
    tl.store(has_out + b, tl.where(a, done == 0, has_codes != 0))
    tl.store(delay_out + b, tl.where(a, new_delay, delay))
    tl.store(countdown_out + b, tl.where(a, new_countdown, countdown))
    tl.store(done_out + b, tl.where(a, done, was_done != 0))


def update_state(
    codes: Tensor, state: DelayState, active: Tensor, boc_id: int, eoc_id: int
) -> tuple[Tensor, DelayState]:
    """``delay.update_state`` (same arguments; new tensors, batch order)."""
    b, n = codes.shape

    def like(t: Tensor) -> Tensor:  # row-major, as the kernel writes (empty_like keeps a permuted layout)
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)

    new = DelayState(
        last_codes=like(state.last_codes), has_codes=like(state.has_codes), delay=like(state.delay),
        countdown=like(state.countdown), done=like(state.done),
    )  # fmt: skip
    emitted = like(codes)
    if b:
        _update_state_kernel[(b,)](
            codes.contiguous(), state.last_codes.contiguous(), state.has_codes.contiguous(), state.delay.contiguous(),
            state.countdown.contiguous(), state.done.contiguous(), active.contiguous(),
            emitted, new.last_codes, new.has_codes, new.delay, new.countdown, new.done,
            BOC=boc_id, EOC=eoc_id, C=n, CP=triton.next_power_of_2(n),
        )  # fmt: skip
    return emitted, new


# --------------------------------------------------------------------------------------------------- the race


@triton.jit
def _first_max(score, index, BIG: tl.constexpr):
    # the lowest ``index`` among the entries of the highest ``score`` (torch's argmax: the first maximum)
    best = tl.max(score, axis=0)
    return tl.min(tl.where(score == best, index, BIG), axis=0)


@triton.jit
def _ordered_bits(x):
    # a float32's bits made order-preserving as int32 (-0.0 as +0.0, as a float comparison sees them)
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _race_sorted(keys, k, p, seed, step, q, V, BLOCK: tl.constexpr, CODE_KEY: tl.constexpr):
    # the race over candidates sorted descending as int64 keys (value bits above the index's complement in BLOCK):
    # top-k, top-p, the noise and the first maximum -> the code
    slot = tl.arange(0, keys.shape[0])
    index = (BLOCK - 1) - (keys & (BLOCK - 1))  # the code at each sorted position
    high = (keys >> 32).to(tl.int32)
    value = tl.where(high < 0, high ^ 0x7FFFFFFF, high).to(tl.float32, bitcast=True)
    # top-k: below the k-th value (ties kept)
    kth = tl.max(tl.where(slot == k - 1, value, float("-inf")), axis=0)
    value = tl.where(value < kth, float("-inf"), value)
    # top-p: drop a code while the mass of it and every less likely code is at most 1 - p (the most likely
    # always stays; p >= 1 or NaN: off), the mass summed from the least likely code up
    e = tl.exp(value - tl.max(value, axis=0))
    mass_up_to = tl.cumsum(e / tl.sum(e, axis=0), axis=0, reverse=True)
    drop = (mass_up_to <= tl.where(p < 1, 1 - p, -1.0)) & (slot > 0)  # no mass is <= -1
    value = tl.where(drop, float("-inf"), value)
    return _noisy_first_max(value, index, seed, step, q, V, BLOCK, CODE_KEY)


@triton.jit
def _noisy_first_max(value, index, seed, step, q, V, BLOCK: tl.constexpr, CODE_KEY: tl.constexpr):
    # the race itself: each code's value plus its seeded noise, the first maximum -> the code (-inf: never chosen)
    lowest = -3.4028234663852886e38  # finfo(float32).min: an allowed code outranks every removed one
    noisy = value - tl.log(-tl.log(_noise_uniform(seed, step, q * V + index, CODE_KEY)))  # x - log(E), E ~ Exp(1)
    noisy = tl.where(noisy != noisy, lowest, noisy)  # NaN
    noisy = tl.where(noisy == float("-inf"), lowest, tl.where(noisy == float("inf"), -lowest, noisy))
    noisy = tl.where(value == float("-inf"), float("-inf"), noisy)
    return _first_max(noisy, index, BLOCK)


@triton.jit
def _race_kernel(
    logits_ptr, stride_b, stride_c, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr, steps_ptr, out_ptr,
    scratch_ptr, V, C: tl.constexpr, FILTER: tl.constexpr, BLOCK: tl.constexpr, CAND: tl.constexpr,
    CODE_KEY: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    b, q = pid // C, pid % C
    i = tl.arange(0, BLOCK)
    inside = i < V
    raw = tl.load(logits_ptr + b * stride_b + q * stride_c + i, mask=inside, other=float("-inf")).to(tl.float32)
    t = tl.load(temperature_ptr + b)
    greedy = t <= 0
    x = tl.math.div_rn(raw, tl.where(greedy, 1.0, t))  # rounded as torch divides (Triton's `/` is approximate)
    overflow = tl.max(((tl.abs(x) == float("inf")) & (tl.abs(raw) < float("inf"))).to(tl.int32), axis=0) > 0
    seed = tl.load(seeds_ptr + b).to(tl.int64)
    step = tl.load(steps_ptr + b).to(tl.int64)
    if FILTER:
        # sort descending, stably (equal values: the lower index first), on int64 keys: the value's order-preserving
        # bits above the index's complement
        ordered = _ordered_bits(x)
        keys = (ordered.to(tl.int64) << 32) | ((BLOCK - 1) - i).to(tl.int64)
        k = tl.load(top_k_ptr + b).to(tl.int64)
        k = tl.where((k <= 0) | (k >= V), V, k)  # k <= 0 or >= V: off
        p = tl.load(top_p_ptr + b)
        code = tl.zeros([], tl.int64) - 1  # not raced yet
        if CAND < BLOCK:  # noqa: SIM102 - a compile-time branch around a run-time one
            if k <= CAND:
                # the k-th largest value by bisection over the ordered bits; the codes at or above it (ties kept)
                # are the only ones the filter can keep: where they are at most CAND, only they are sorted
                lo = tl.min(ordered, axis=0).to(tl.int64)
                hi = tl.max(ordered, axis=0).to(tl.int64)
                while lo < hi:
                    mid = lo + (hi - lo + 1) // 2
                    enough = tl.sum((ordered >= mid).to(tl.int32), axis=0) >= k
                    lo = tl.where(enough, mid, lo)
                    hi = tl.where(enough, hi, mid - 1)
                keep = ordered >= lo
                count = tl.sum(keep.to(tl.int32), axis=0)
                if count <= CAND:
                    row = scratch_ptr + pid * CAND
                    tl.store(row + tl.cumsum(keep.to(tl.int32), axis=0) - 1, keys, mask=keep)
                    tl.debug_barrier()  # every thread's stores before the loads below (one program, global memory)
                    slot = tl.arange(0, CAND)
                    few = tl.load(row + slot, mask=slot < count, other=0)
                    # the empty slots get the key of -inf (its ordered bits): below every candidate
                    few = tl.where(slot < count, few, tl.full([CAND], -2139095041, tl.int64) << 32)
                    code = _race_sorted(tl.sort(few, descending=True), k, p, seed, step, q, V, BLOCK, CODE_KEY)
        if code < 0:  # every code sorted: top-k off or past CAND, or more than CAND codes tie at the k-th value
            code = _race_sorted(tl.sort(keys, descending=True), k, p, seed, step, q, V, BLOCK, CODE_KEY)
    else:
        code = _noisy_first_max(x, i.to(tl.int64), seed, step, q, V, BLOCK, CODE_KEY)
    code = tl.where(greedy | overflow, _first_max(raw, i.to(tl.int64), BLOCK), code)
    tl.store(out_ptr + pid, code)


def race_argmax(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor, steps: Tensor, code_key: int,
    filter: bool = True,
) -> Tensor:  # fmt: skip
    """``sampling.sample_codes`` with ``draw=True``: logits [B, C, V] -> codes [B, C] int64, one program per
    (request, codebook) row: the temperature, the top-k/top-p filter (``filter``), the noise and the race."""
    if not race_supports(logits, temperature, top_k, top_p, seeds, steps, code_key):
        raise ValueError(
            f"the race kernel takes logits [B, C, V] (unit stride along V, V <= {RACE_MAX_VOCAB}) with temperature, "
            f"top_p [B] fp32, top_k, seeds, steps [B] int64; got logits {tuple(logits.shape)} {logits.dtype} "
            f"strides {logits.stride()}, temperature {temperature.dtype}, top_k {top_k.dtype}, top_p {top_p.dtype}, "
            f"seeds {seeds.dtype}, steps {steps.dtype}"
        )
    b, n, v = logits.shape
    out = torch.empty(b, n, dtype=torch.long, device=logits.device)
    block = triton.next_power_of_2(v)
    scratch = torch.empty(b * n * RACE_CANDIDATES if filter and block > RACE_CANDIDATES else 1, dtype=torch.long,
                          device=logits.device)  # fmt: skip
    if b:
        _race_kernel[(b * n,)](
            logits, logits.stride(0), logits.stride(1), temperature.contiguous(), top_k.contiguous(),
            top_p.contiguous(), seeds.contiguous(), steps.contiguous(), out, scratch, v, C=n, FILTER=filter,
            BLOCK=block, CAND=RACE_CANDIDATES, CODE_KEY=code_key,
        )  # fmt: skip
    return out

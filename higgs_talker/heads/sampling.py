"""Code sampling: per-request temperature / top-k / top-p over all codebooks, seeded, without host syncs.

Randomness comes from a counter-based hash of ``(request seed, row index, codebook, code)``: the noise a
request sees depends on nothing else, so a seeded request draws the same noise alone or in any batch (the hash
words are equal on CPU and CUDA; their ``log`` may differ there by an ulp), and the whole step can live in a
CUDA graph (no ``torch.Generator`` per request). Sampling is
the exponential race ``argmax(p / E)`` with ``E ~ Exp(1)``, which draws from ``p`` exactly; it runs in log form
(``argmax(log p - log E)``), where a code the masks or filters removed scores -inf and can never win.
"""

from __future__ import annotations

import math
import numbers
import random
import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

from . import fused

_M32 = 0xFFFFFFFF
CODE_KEY = 0x9E3779B9  # added to each code's index before it is hashed (noise_words)
MAX_SEED = 2**63 - 1
FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: the engine keeps temperature in float32
MAX_FRAMES = 2**31 - 1  # max_frames / min_frames bound: row indices stay inside the 32-bit word the noise hashes
TOP_K_CAP = 2**31 - 1  # a larger top_k is held as this: both keep every code of any codebook


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling of the 8 codes of each frame.

    temperature: 0 is greedy (argmax); > 0 scales the logits. top_k: keep the k most likely codes
    (-1 or 0: off). top_p: nucleus mass in (0, 1]. seed: makes the request reproducible and
    independent of its batch; None draws a fresh seed per request. max_frames: most audio frames (rows of
    the aligned output) before the request is cut off. min_frames: codebook 0 may not end the stream (sample
    EOC) before this many rows, so the aligned output has at least min_frames frames. A request needs
    min_frames <= max_frames; that is checked where it is queued (``check_lengths``), after
    ``generate(max_frames=...)`` has replaced the field, so ``SamplingParams(min_frames=3000)`` is a valid
    value next to the default max_frames of 2048.

    Every value must be storable where the engine keeps it: temperature at most float32's largest value,
    max_frames at most 2**31 - 1; a top_k above 2**31 - 1 is held as 2**31 - 1 (both keep every code). numpy
    integer and float scalars are accepted and held as Python int / float.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_frames: int = 2048
    min_frames: int = 0

    def __post_init__(self) -> None:
        # numpy scalars (np.int64, np.float32, ...) are accepted and held as Python int / float.
        t = _as_float(self.temperature)
        if t is None or not math.isfinite(t) or not 0 <= t <= FP32_MAX:
            raise ValueError(
                f"temperature must be a finite number in [0, {FP32_MAX:.6g}] (0 = greedy; the engine keeps it in "
                f"float32), got {self.temperature!r}"
            )
        k = _as_int(self.top_k)
        if k is None or k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or -1 / 0 to disable it, got {self.top_k!r}")
        p = _as_float(self.top_p)
        if p is None or not (0 < p <= 1):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        s = None if self.seed is None else _as_int(self.seed)
        if self.seed is not None and (s is None or not 0 <= s <= MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        m = _as_int(self.max_frames)
        if m is None or m <= 0:
            raise ValueError(f"max_frames must be an integer > 0, got {self.max_frames!r}")
        if m > MAX_FRAMES:
            raise ValueError(f"max_frames must be at most {MAX_FRAMES} (2**31 - 1), got {self.max_frames!r}")
        lo = _as_int(self.min_frames)
        if lo is None or not 0 <= lo <= MAX_FRAMES:
            raise ValueError(f"min_frames must be an integer in [0, {MAX_FRAMES}], got {self.min_frames!r}")
        for name, value in (
            ("temperature", t),
            ("top_k", min(k, TOP_K_CAP)),
            ("top_p", p),
            ("seed", s),
            ("max_frames", m),
            ("min_frames", lo),
        ):
            object.__setattr__(self, name, value)

    def check_lengths(self) -> SamplingParams:
        """Refuse min_frames above max_frames (naming both); returns self."""
        if self.min_frames > self.max_frames:
            raise ValueError(
                f"min_frames={self.min_frames} is more than max_frames={self.max_frames}: a request cannot be held "
                "open past its own cap (raise max_frames or lower min_frames)"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolved_seed(self) -> int:
        """The seed to use: the given one, or a fresh random one (no seed is pinned by default)."""
        return resolve_seed(self.seed)


def resolve_seed(seed: int | None, draw: random.Random | None = None) -> int:
    """A request's sampling seed: ``seed`` folded into [0, MAX_SEED] (vLLM's seeds may lie outside), or, for
    None, the next draw of ``draw`` (a seeded generator: every tensor-parallel rank draws the same sequence) or
    a fresh one from the OS."""
    if seed is not None:
        return seed % (MAX_SEED + 1)
    return draw.randrange(MAX_SEED) if draw is not None else secrets.randbelow(MAX_SEED)


def is_greedy(temperature: Tensor) -> Tensor:
    """The one greedy rule of every front end: temperature [B] <= 0 takes the argmax (a tiny positive
    temperature samples, and falls back to the argmax only where ``logits / T`` overflows)."""
    return temperature <= 0


def row_params(
    num_rows: int, device: torch.device, temperature: Tensor | None, top_k: Tensor | None, top_p: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (temperature [B] fp32, top_k [B] int64, top_p [B] fp32) from a front end's per-row values, with
    None meaning greedy / off / off. A non-finite temperature or top_p samples at 1 / keeps every code; top_p is
    clamped into [0, 1] and 0 means off; top_k <= 0 (or >= the codebook size) is off, as ``sample_codes`` reads
    it. Greedy is ``is_greedy``: no threshold of the front end's own."""
    f32 = torch.float32
    t = torch.zeros(num_rows, dtype=f32, device=device) if temperature is None else temperature[:num_rows].float()
    k = torch.zeros(num_rows, dtype=torch.long, device=device) if top_k is None else top_k[:num_rows].long()
    p = torch.ones(num_rows, dtype=f32, device=device) if top_p is None else top_p[:num_rows].float()
    t = torch.where(torch.isfinite(t), t, 1.0)
    p = torch.where(torch.isfinite(p), p.clamp(0.0, 1.0), 1.0)
    return t, k, torch.where(p <= 0, 1.0, p)


def _as_int(value: object) -> int | None:
    """A Python or numpy integer as ``int``; None for anything else (bool, float, str, ...)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def _as_float(value: object) -> float | None:
    """A Python or numpy real number (integers included) as ``float``; None for anything else (bool, str, ...)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _word(x: Tensor) -> Tensor:
    """int64 values in [0, 2**32) -> the same 32 bits in int32 (two's complement), where the hash runs."""
    return (x & _M32).to(torch.int32)


def _srl(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int32 bit patterns (``>>`` copies the sign bit in)."""
    return (x >> k) & ((1 << (32 - k)) - 1)


def _mul32(x: Tensor, m: int) -> Tensor:
    """(x * m) mod 2**32 on int32 bit patterns: an int32 product keeps its low 32 bits."""
    return x * (m - 2**32 if m >= 2**31 else m)


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xorshift-multiply finaliser) on int32 bit patterns."""
    x = x ^ _srl(x, 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ _srl(x, 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ _srl(x, 16)


def uniform_from_bits(bits: Tensor) -> Tensor:
    """Random 32-bit words (int64 tensor, values < 2**32) -> uniform fp32 in the open interval (0, 1).

    The top 23 bits ``k`` map to ``(k + 0.5) / 2**23``, which fp32 holds exactly: the result lies in
    [2**-24, 1 - 2**-24], so ``-log(u)`` is finite and strictly positive for every word. (With 24 bits the
    largest value, (2**24 - 0.5) / 2**24, rounds to 1.0 in fp32 and its noise to -0.0.)
    """
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def _check_noise_size(n: int) -> None:
    if not fused.noise_supports(n, CODE_KEY):
        raise ValueError(f"noise for {n} codes a row: every code index plus CODE_KEY must stay below 2**32")


def noise_words(seeds: Tensor, steps: Tensor, n: int) -> Tensor:
    """The hash words [B, n] int64 (each < 2**32) of code indices 0..n-1 for each (seed, step) pair [B] int64:
    the torch reference of the noise (``triton_kernels.uniform_noise`` computes the same words in one kernel).
    The hash runs on int32 bit patterns (a tenth of the time of an int64 emulation on CPU); every index plus
    ``CODE_KEY`` must be a 32-bit word (``fused.noise_supports``: about 1.6e9 codes a row)."""
    _check_noise_size(n)
    h = _mix32(_word(seeds))
    h = _mix32(h ^ _word(seeds >> 32))
    h = _mix32(h ^ _word(steps))  # [B]
    idx = _word(torch.arange(n, device=seeds.device, dtype=torch.long) + CODE_KEY)
    bits = _mix32(h[:, None] ^ _mix32(idx)[None, :])
    bits = _mix32(bits ^ h[:, None])  # second round: decorrelates neighbouring (seed, step) pairs
    return bits.long() & _M32


def uniform_noise(seeds: Tensor, steps: Tensor, n: int) -> Tensor:
    """Uniform fp32 [B, n] in (0, 1) from the hash words (``uniform_from_bits(noise_words(...))``): one Triton
    kernel on CUDA once it is checked (``heads.fused``), the torch operations elsewhere; the values are equal."""
    _check_noise_size(n)
    return fused.run_checked(
        "sampler noise", seeds, lambda k, checking: k.uniform_noise(seeds, steps, n, CODE_KEY),
        lambda checking: uniform_from_bits(noise_words(seeds, steps, n)), fused.same_values, (seeds, steps, n),
    )  # fmt: skip


def exponential_noise(seeds: Tensor, steps: Tensor, num_codebooks: int, codebook_size: int) -> Tensor:
    """Exp(1) noise [B, C, V] fp32, finite and > 0, that is a pure function of (seeds [B], steps [B]) int64."""
    u = uniform_noise(seeds, steps, num_codebooks * codebook_size)
    return (-torch.log(u)).view(-1, num_codebooks, codebook_size)


def top_k_top_p_filter(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask logits [M, V] fp32 outside each row's top-k (k [M]; <= 0 or >= V: off), then outside its top-p
    nucleus (p [M]; >= 1 or NaN: off). Returns a new tensor.

    Ties at the k-th value are kept. The nucleus rule is vLLM's ``apply_top_k_top_p``: going from the least
    likely code up, a code is dropped while the mass of it and every less likely code is at most 1 - p; the most
    likely code always stays. Summing from the tail up keeps that mass exact to a few ulps of itself, where a
    running sum from the top would reach 1.0 in fp32 with up to ~1e-7 of mass still to come and drop that tail
    at p = 1. The sort is stable, so among equal logits the lowest index counts as more likely, and the code
    that always stays is the one ``argmax`` picks.
    """
    v = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    k = torch.where(top_k <= 0, v, top_k.long())
    kth = sorted_logits.gather(1, (k - 1).clamp(0, v - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # softmax and running sum over the ascending order, as vLLM computes them, then back to descending
    mass_up_to = sorted_logits.flip(-1).softmax(dim=-1).cumsum(dim=-1).flip(-1)  # [M, V]: this code and all below
    p = top_p.float()[:, None]
    drop = (mass_up_to <= 1 - p) & (p < 1)  # p >= 1 (or NaN): no nucleus, every code stays
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def race_scores(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    seeds: Tensor,
    steps: Tensor,
    *,
    filter: bool = True,
) -> Tensor:
    """What the sampler takes the argmax of: masked logits [B, C, V] -> scores [B, C, V] fp32.

    Sampled rows race ``x / T - log(E)`` with ``E ~ Exp(1)`` (the Gumbel-max form of ``argmax(p / E)``, which
    draws from ``softmax(x / T)`` exactly). Every code that the masks or the top-k/top-p filter removed scores
    -inf whatever the noise, so it can never win. Greedy rows (temperature 0) score their masked logits, and so
    does a row where ``x / T`` overflows (the temperature -> 0 limit: a finite logit became +-inf).
    """
    b, n, v = logits.shape
    x = logits.float()
    greedy = is_greedy(temperature)
    x = x / torch.where(greedy, 1.0, temperature.float())[:, None, None]
    overflow = (x.isinf() & logits.isfinite()).any(dim=-1, keepdim=True)  # [B, C, 1]: a finite logit left range
    if filter:
        x = top_k_top_p_filter(x.view(b * n, v), top_k.repeat_interleave(n), top_p.repeat_interleave(n))
        x = x.view(b, n, v)
    lowest = torch.finfo(torch.float32).min  # any allowed code, whatever its noise, outranks every removed one
    noisy = (x - exponential_noise(seeds, steps, n, v).log()).nan_to_num(nan=lowest, neginf=lowest)
    noisy = torch.where(x == float("-inf"), float("-inf"), noisy)
    return torch.where(greedy[:, None, None] | overflow, logits.float(), noisy)


def sample_codes(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    seeds: Tensor,
    steps: Tensor,
    *,
    draw: bool = True,
    filter: bool = True,
) -> Tensor:
    """Masked codebook logits [B, C, V] -> codes [B, C] int64 (``argmax`` of ``race_scores``).

    temperature/top_p [B] float (top_p >= 1 or NaN: off), top_k [B] int (<= 0 or >= codebook_size: off),
    seeds/steps [B] int64 (the step is the request's row index, so its noise never repeats). Rows with
    temperature 0 take the argmax. ``draw=False`` (every row greedy) and ``filter=False`` (no row has top-k/top-p
    on) are host-known shortcuts that skip work without changing the result.
    """
    if not draw:
        return logits.argmax(dim=-1)

    def reference(checking: bool) -> Tensor:
        return race_scores(logits, temperature, top_k, top_p, seeds, steps, filter=filter).argmax(dim=-1)

    args = (logits, temperature, top_k, top_p, seeds, steps)
    return fused.run_checked(
        "sampler race", logits, lambda k, checking: k.race_argmax(*args, CODE_KEY, filter), reference,
        fused.same_values, (*args, filter), supported=lambda: fused.race_supports(*args, CODE_KEY),
    )  # fmt: skip

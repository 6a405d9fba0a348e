"""Band-limited resampling with a Hann-windowed sinc: the filter torchaudio's ``resample`` uses by default.

Upstream resamples reference audio (any rate -> 24 kHz) and, inside the codec, 24 -> 16 kHz for HuBERT with
``torchaudio.functional.resample`` at its defaults. torchaudio does not load beside the CPU torch we run on
(SPEC_codec 6), and another resampler (soxr, libsamplerate, scipy's polyphase filter) uses another filter:
HuBERT would see a different input and the codes would change. So this module computes the same filter
(same cut-off, window and length) with plain torch ops, on any device.

The method: reduce ``orig / new`` by their gcd to ``a / b``. Output sample ``j`` sits at input position
``j a / b``; it is the input convolved with ``h(t) = r sinc(r t) w(r t / z)``, where ``r = rolloff * min(a, b) / a``
is the cut-off relative to the input rate, ``w`` a Hann window over ``|x| <= 1`` and ``z`` the number of
zero crossings kept on each side. The ``b`` output phases repeat every ``a`` inputs, so one strided
convolution with ``b`` filters computes them all.

Difference from torchaudio: torchaudio evaluates the filter taps in the waveform's dtype; here they are
evaluated in float64 and rounded once. For float32 input the results differ by float rounding only
(``tests/test_codec.py`` measures it where torchaudio imports).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

ZERO_CROSSINGS = 6  # lowpass_filter_width in torchaudio
ROLLOFF = 0.99


def resample(x: Tensor, orig: int, new: int) -> Tensor:
    """x [..., N] float -> [..., ceil(N * new / orig)] at ``new`` Hz (the same tensor when the rates are equal)."""
    if orig == new:
        return x
    g = math.gcd(orig, new)
    a, b = orig // g, new // g
    taps, width = _filter(a, b)
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])
    n = shape[-1]
    padded = F.pad(flat, (width, width + a))
    out = F.conv1d(padded, taps.to(device=x.device, dtype=x.dtype), stride=a)  # [M, b, blocks]
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)[:, : -(-n * b // a)]
    return out.reshape(*shape[:-1], out.shape[-1])


@lru_cache(maxsize=16)
def _filter(a: int, b: int) -> tuple[Tensor, int]:
    """The ``b`` phase filters [b, 1, 2 * width + a] (float64) for input/output rates reduced to ``a`` / ``b``."""
    cutoff = ROLLOFF * min(a, b)  # in units of the reduced rates
    width = math.ceil(ZERO_CROSSINGS * a / cutoff)  # taps needed on each side to reach the last zero crossing
    k = torch.arange(-width, width + a, dtype=torch.float64) / a  # input offsets, in units of a samples
    phase = -torch.arange(b, dtype=torch.float64)[:, None] / b  # output j's offset within its block
    t = ((phase + k) * cutoff).clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS)  # in zero crossings
    window = torch.cos(t * math.pi / (2 * ZERO_CROSSINGS)) ** 2
    taps = torch.sinc(t) * window * (cutoff / a)
    return taps[:, None, :], width

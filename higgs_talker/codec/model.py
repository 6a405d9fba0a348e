"""The codec network on transformers' DAC and HuBERT modules, with names equal to ``HiggsAudioV2TokenizerModel``'s.

transformers' own ``HiggsAudioV2TokenizerModel`` imports torchaudio at the top of its module, and no torchaudio
wheel loads beside the CPU torch we run on (SPEC_codec 6). Its heavy parts are plain transformers modules that
do not: ``DacDecoder`` / ``DacEncoder`` (the acoustic codec) and ``HubertModel`` (the semantic model). This
module assembles those with the small pieces that live in the torchaudio-importing file: the residual vector
quantizer and the semantic encoder (a few convolutions), written here, and the 24 -> 16 kHz resampling
(``resample.py``). Parameter and buffer names equal ``HiggsAudioV2TokenizerModel.state_dict()``'s, so the
bundled checkpoint keys load unchanged; ``tests/test_codec.py`` checks names and decoding against transformers'
class everywhere, and encoding wherever torchaudio imports.

Decoding needs only the quantizer's codebooks and output projections, ``fc2`` and the DAC decoder; a
decode-only model builds nothing else. Training-only tensors of the checkpoint (codebook EMA statistics,
``fc1``, ``decoder_semantic``) are never built: ``unused_shapes`` lists them so the loader can check them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import spec_of
from .resample import resample


class Codebook(nn.Module):
    """One quantizer's code vectors: ``embed [K, D]`` (a buffer, as in transformers)."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Buffer(torch.zeros(size, dim))

    def nearest(self, x: Tensor) -> Tensor:
        """x [..., D] fp32 -> index [...] int64 of the code vector at the smallest Euclidean distance."""
        flat = x.reshape(-1, x.shape[-1])
        embed_t = self.embed.t()
        # -|x - e|^2 expanded; the same expression as transformers', so ties break the same way
        score = -(flat.pow(2).sum(1, keepdim=True) - 2 * flat @ embed_t + embed_t.pow(2).sum(0, keepdim=True))
        return score.max(dim=-1).indices.view(x.shape[:-1])


class Quantizer(nn.Module):
    """One residual stage: ``project_in`` (encode only) -> nearest code; code -> ``project_out``."""

    def __init__(self, hidden: int, size: int, dim: int, encoder: bool) -> None:
        super().__init__()
        self.codebook = Codebook(size, dim)
        if encoder:
            self.project_in = nn.Linear(hidden, dim)
        self.project_out = nn.Linear(dim, hidden)

    def lookup(self, codes: Tensor) -> Tensor:
        """codes [B, T] int64 -> [B, T, H]."""
        return self.project_out(F.embedding(codes, self.codebook.embed))


class ResidualVQ(nn.Module):
    """``quantizer``: the residual vector quantizer; kept in fp32 whatever the codec dtype (as upstream)."""

    def __init__(self, num_quantizers: int, hidden: int, size: int, dim: int, encoder: bool) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(Quantizer(hidden, size, dim, encoder) for _ in range(num_quantizers))

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, Q, T] int64 -> summed code vectors [B, T, H] fp32."""
        out = self.quantizers[0].lookup(codes[:, 0])
        for i in range(1, len(self.quantizers)):
            out = out + self.quantizers[i].lookup(codes[:, i])
        return out

    def encode(self, x: Tensor) -> Tensor:
        """x [B, T, H] fp32 -> codes [B, Q, T] int64: each stage codes what the stages before left over."""
        residual, codes = x, []
        for q in self.quantizers:
            index = q.codebook.nearest(q.project_in(residual))
            residual = residual - q.lookup(index)
            codes.append(index)
        return torch.stack(codes, dim=1)


class _ResidualUnit(nn.Module):
    """ELU -> dilated conv -> ELU -> 1x1 conv, added to the input (no biases)."""

    def __init__(self, channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2 * dilation, dilation=dilation,
                               bias=False)  # fmt: skip
        self.conv2 = nn.Conv1d(channels, channels, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))


class _SemanticBlock(nn.Module):
    def __init__(self, channels: int, out_channels: int, stride: int, unit_kernel: int, dilations) -> None:
        super().__init__()
        self.res_units = nn.ModuleList(_ResidualUnit(channels, unit_kernel, d) for d in dilations)
        kernel = 3 if stride == 1 else 2 * stride
        self.conv = nn.Conv1d(channels, out_channels, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x: Tensor) -> Tensor:
        for unit in self.res_units:
            x = unit(x)
        return self.conv(x)


class SemanticEncoder(nn.Module):
    """``encoder_semantic``: a conv and residual conv blocks over HuBERT features [B, S, T] -> [B, S', T']."""

    def __init__(self, config) -> None:
        super().__init__()
        width = config.semantic_model_config.hidden_size
        self.conv = nn.Conv1d(width, width, config.kernel_size, padding=config.kernel_size // 2, bias=False)
        blocks, channels = [], width
        for stride, ratio in zip(config.strides, config.channel_ratios, strict=True):
            out = int(width * ratio)
            blocks.append(_SemanticBlock(channels, out, stride, config.unit_kernel_size, config.block_dilations))
            channels = out
        self.conv_blocks = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


class CodecModel(nn.Module):
    """Codes [B, Q, T] <-> waveform [B, 1, T * hop]; ``encoder=False`` builds the decoding half only."""

    def __init__(self, config, encoder: bool = True) -> None:
        from transformers.models.dac.modeling_dac import DacDecoder, DacEncoder

        super().__init__()
        self.config, self.spec, self.has_encoder = config, spec_of(config), encoder
        s = self.spec
        self.quantizer = ResidualVQ(s.num_quantizers, s.hidden_size, s.codebook_size, s.codebook_dim, encoder)
        self.fc2 = nn.Linear(s.hidden_size, config.acoustic_model_config.hidden_size)
        self.acoustic_decoder = DacDecoder(config.acoustic_model_config)
        for module in self.acoustic_decoder.modules():
            # Higgs' DAC differs from DAC's: an odd stride's transposed conv emits one more sample (so every
            # block upsamples exactly by its stride), and there is no tanh at the end (SPEC_codec 3.3)
            if isinstance(module, nn.ConvTranspose1d):
                module.output_padding = (module.stride[0] % 2,)
        self.acoustic_decoder.tanh = nn.Identity()
        if encoder:
            from transformers.models.hubert.modeling_hubert import HubertModel

            self.acoustic_encoder = DacEncoder(config.acoustic_model_config)
            semantic = config.semantic_model_config
            if semantic.mask_time_prob > 0 or semantic.mask_feature_prob > 0:  # masking is training-only
                semantic = type(semantic).from_dict({**semantic.to_dict(), "mask_time_prob": 0.0,
                                                     "mask_feature_prob": 0.0})  # fmt: skip
            self.semantic_model = HubertModel(semantic)
            self.encoder_semantic = SemanticEncoder(config)
            self.fc = nn.Linear(s.hidden_size, s.hidden_size)

    # -------------------------------------------------------------------------------------------- decoding

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, Q, T] int64 -> waveform [B, 1, T * hop] in the decoder's dtype."""
        summed = self.quantizer.decode(codes)  # [B, T, H] fp32
        # Upstream holds the RVQ sum as a contiguous [B, H, T] and feeds fc2 its transpose; the same layout makes
        # fc2 round as upstream does, which the deep decoder would otherwise amplify (SPEC_codec 3.8).
        summed = summed.transpose(1, 2).contiguous().transpose(1, 2)
        latent = self.fc2(summed.to(self.fc2.weight.dtype))  # [B, T, C]
        return self.acoustic_decoder(latent.transpose(1, 2))

    # -------------------------------------------------------------------------------------------- encoding

    def encode(self, wav: Tensor) -> Tensor:
        """wav [B, 1, N] at the codec sample rate (fp32) -> codes [B, Q, T] int64."""
        if not self.has_encoder:
            raise ValueError("this codec was loaded for decoding only; load it with parts='full' to encode")
        dtype = self.fc.weight.dtype
        semantic = self.encoder_semantic(self._semantic_features(wav).to(dtype).transpose(1, 2))  # [B, S, T]
        frames = semantic.shape[-1]
        x = wav.to(dtype)
        if acoustic_frames(self.acoustic_encoder, x.shape[-1]) != frames:
            pad = self.spec.hop_length // 2  # centre the acoustic frames on the semantic ones
            x = F.pad(x, (pad, pad))
        acoustic = self.acoustic_encoder(x)
        if acoustic.shape[-1] != frames:
            raise ValueError(
                f"{wav.shape[-1]} samples give {acoustic.shape[-1]} acoustic but {frames} semantic frames; "
                "the two branches of the encoder disagree at this length"
            )
        joint = torch.cat([acoustic, semantic], dim=1).transpose(1, 2)  # [B, T, H]
        return self.quantizer.encode(self.fc(joint).float())

    def _semantic_features(self, wav: Tensor) -> Tensor:
        """wav [B, 1, N] fp32 -> HuBERT features [B, T, S]: all hidden states averaged, one per codec frame."""
        s = self.spec
        x = resample(wav[:, 0], s.sample_rate, s.semantic_sample_rate)
        x = F.pad(x, (160, 160)).to(self.fc.weight.dtype)  # 10 ms each side at 16 kHz, as the codec was trained
        hidden = self.semantic_model(x, output_hidden_states=True).hidden_states
        features = torch.stack(hidden, dim=1).mean(dim=1)
        return features[:, :: s.semantic_downsample]


def acoustic_frames(encoder: nn.Module, samples: int) -> int:
    """Frames the DAC encoder makes of ``samples`` (its convolutions in order, without running it)."""
    length = samples
    for conv in encoder.modules():
        if isinstance(conv, nn.Conv1d):
            k, s, p, d = conv.kernel_size[0], conv.stride[0], conv.padding[0], conv.dilation[0]
            length = (length + 2 * p - d * (k - 1) - 1) // s + 1
    return length


def unused_shapes(config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensors no inference path reads (training state), with their shapes, for the loader's checks."""
    s = spec_of(config)
    width = config.semantic_model_config.hidden_size
    k, uk = config.kernel_size, config.unit_kernel_size
    out: dict[str, tuple[int, ...]] = {"fc1.weight": (width, s.hidden_size), "fc1.bias": (width,)}
    for i in range(s.num_quantizers):
        p = f"quantizer.quantizers.{i}.codebook."
        out |= {p + "embed_avg": (s.codebook_size, s.codebook_dim), p + "cluster_size": (s.codebook_size,),
                p + "inited": (1,)}  # fmt: skip
    # decoder_semantic: the semantic branch's reconstruction head, used only by the training loss
    ratios = list(config.channel_ratios)
    out["decoder_semantic.conv1.weight"] = (int(width * ratios[0]), width, k)
    for i, stride in enumerate(config.strides):
        c_in = int(width * ratios[i])
        c_out = int(width * ratios[i + 1]) if i + 1 < len(ratios) else width
        p = f"decoder_semantic.conv_blocks.{i}."
        if stride == 1:
            out |= {p + "conv.weight": (c_out, c_in, 3), p + "conv.bias": (c_out,)}
        else:
            out[p + "conv.weight"] = (c_in, c_out, 2 * stride)  # a transposed conv, no bias
        for j in range(len(config.block_dilations)):
            out |= {p + f"res_units.{j}.conv1.weight": (c_out, c_out, uk), p + f"res_units.{j}.conv2.weight":
                    (c_out, c_out, 1)}  # fmt: skip
    out["decoder_semantic.conv2.weight"] = (width, width, k)
    return out


def decoder_reach(decoder: nn.Module, hop: int) -> tuple[int, int]:
    """(frames before, frames after) whose codes can change a frame's decoded samples.

    Walks the DAC decoder's layers backwards from the output samples of one frame, keeping at every layer the
    span of that layer's input it reads, and counts how many whole frames each span reaches past the frame on
    either side. A window that gives a frame this much context decodes it exactly as the whole utterance does:
    no zero padding at the window's edges reaches it (the chunked-decoding rule of ``streaming.py``).
    """
    rate = hop  # samples per frame at the current layer's output
    first, last = rate, 2 * rate - 1  # frame 1's own samples
    before = after = 0
    for kind, k, s, p, d in reversed(decoder_convolutions(decoder)):
        if kind == "conv":  # stride 1: out[n] reads in[n - p + d * j] for j = 0 .. k - 1
            first, last = first - p, last - p + d * (k - 1)
        else:  # transposed: out[n] reads in[i] wherever 0 <= n + p - i * s < k
            first, last = -((-(first + p - k + 1)) // s), (last + p) // s
            if rate % s:
                raise ValueError(f"the DAC decoder's strides do not divide its hop {hop}")
            rate //= s
        before = max(before, -((first - rate) // rate))  # whole frames reached before frame 1 (ceil)
        after = max(after, -((2 * rate - 1 - last) // rate))
    if rate != 1:
        raise ValueError(f"the DAC decoder upsamples by {hop // rate}, not by its hop {hop}")
    return before, after


def decoder_convolutions(decoder: nn.Module) -> list[tuple[str, int, int, int, int]]:
    """The DAC decoder's convolutions in the order its signal meets them: (kind, kernel, stride, padding, dilation).

    A residual unit's span is its dilated conv's (the 1x1 conv and the skip add nothing wider); its depth counts
    both.
    """
    out = []
    for module in decoder.modules():
        if isinstance(module, nn.ConvTranspose1d):
            out.append(("transposed", module.kernel_size[0], module.stride[0], module.padding[0], 1))
        elif isinstance(module, nn.Conv1d):
            if module.stride[0] != 1:
                raise ValueError(f"the DAC decoder has a strided conv ({module}); its reach is not derived")
            out.append(("conv", module.kernel_size[0], 1, module.padding[0], module.dilation[0]))
    return out

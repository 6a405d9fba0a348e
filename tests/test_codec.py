"""The Stage-1 codec (``higgs_talker.codec``) on the tiny checkpoint's bundled codec.

References, each independent of the code under test:

- a float64 recomputation of the decoder written here from the DAC definitions (RVQ sum -> fc2 -> conv,
  Snake, transposed convs, residual units) on the raw safetensors tensors;
- a float64 direct evaluation of the windowed-sinc interpolation formula for the resampler;
- transformers' ``HiggsAudioV2TokenizerModel`` on the same tensors: its state-dict layout and ``decode``
  everywhere, CI included (neither touches torchaudio, which does not load beside CI's CPU torch); ``encode``
  and torchaudio's resampler only where torchaudio imports (the GPU image);
- upstream's streaming schedule as measured in SPEC_codec 4.3, and the encoder lengths of SPEC_codec 5.4.

Tolerances come from ``_tolerance.py``: the decoder is a chain of reductions of known lengths.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _tolerance import chain_rel_tol, gamma, rel_err, unit_roundoff
from safetensors.torch import load_file, save_file

from higgs_talker.checkpoint import CODEC_PREFIX
from higgs_talker.codec import (
    CODEC_CONFIG_FILE,
    FAST_START_CHUNKING,
    HIGGS_V3_CODEC,
    TINY_CODEC,
    UPSTREAM_CHUNKING,
    AudioChunking,
    Codec,
    build_config,
    chunk_due,
    config_to_dict,
    next_window,
    random_tensors,
)
from higgs_talker.codec.model import CodecModel, decoder_reach
from higgs_talker.codec.resample import resample
from higgs_talker.codec.streaming import connector_rule, delayed_rows_chunk
from higgs_talker.codec.weights import expected_shapes, unused_shapes
from higgs_talker.heads.delay import aligned_codes, codec_frames
from higgs_talker.tiny import tiny_config, tiny_weights

HOP = 960


# ---------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tensors(tiny_dir: Path) -> dict[str, torch.Tensor]:
    """The tiny checkpoint's codec tensors, as stored (BF16), prefix stripped."""
    raw = load_file(str(tiny_dir / "model.safetensors"))
    return {k[len(CODEC_PREFIX) :]: v for k, v in raw.items() if k.startswith(CODEC_PREFIX)}


@pytest.fixture(scope="module")
def codec(tiny_dir: Path) -> Codec:
    return Codec.from_pretrained(tiny_dir, encoder=True)


@pytest.fixture(scope="module")
def codec_bf16(tiny_dir: Path) -> Codec:
    return Codec.from_pretrained(tiny_dir, dtype="bfloat16")


def random_codes(frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1024, (frames, 8), generator=torch.Generator().manual_seed(seed))


HF_CODEC_PACKAGE = "transformers.models.higgs_audio_v2_tokenizer"
HF_CODEC_MODULE = f"{HF_CODEC_PACKAGE}.modeling_higgs_audio_v2_tokenizer"


class _TorchaudioAbsent(types.ModuleType):
    """Sits where torchaudio would while transformers' codec module imports; any use of it raises."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"torchaudio.{name} was reached, but torchaudio does not import here")


def torchaudio_or_skip():
    """torchaudio, or a skip saying why it is not usable here."""
    try:
        import torchaudio
    except Exception as exc:  # noqa: BLE001 - a CUDA torchaudio beside CPU torch fails with OSError, not ImportError
        pytest.skip(f"torchaudio does not import here: {exc}")
    from transformers.utils.import_utils import is_torchaudio_available

    if not is_torchaudio_available():
        pytest.skip("transformers does not see torchaudio")
    return torchaudio


def transformers_codec_class() -> type:
    """transformers' ``HiggsAudioV2TokenizerModel``, the real class, whether or not torchaudio imports.

    Its module imports torchaudio at the top and uses it only to resample inside ``encode``; building the model,
    its state dict and ``decode`` never touch it. Where torchaudio does not import (CI's CPU torch), the module is
    imported once with ``_TorchaudioAbsent`` in ``sys.modules`` for the duration of the import, so the layout and
    decode comparisons run everywhere, and one that reached torchaudio would fail, not pass on a stand-in. Its
    other imports come first, so that transformers' own torchaudio probe never sees the placeholder.
    """
    if HF_CODEC_MODULE not in sys.modules:
        try:
            import torchaudio  # noqa: F401
        except Exception:  # noqa: BLE001 - as in torchaudio_or_skip
            importlib.import_module("transformers.models.xcodec.modeling_xcodec")  # the same imports, torchaudio aside
            importlib.import_module(f"{HF_CODEC_PACKAGE}.configuration_higgs_audio_v2_tokenizer")
            sys.modules["torchaudio"] = _TorchaudioAbsent("torchaudio")
            try:
                importlib.import_module(HF_CODEC_MODULE)
            finally:
                del sys.modules["torchaudio"]
    return importlib.import_module(HF_CODEC_MODULE).HiggsAudioV2TokenizerModel


# ---------------------------------------------------------------------------------------------------------
# an independent float64 decoder


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Snake activation x + sin^2(alpha x) / alpha (with DAC's 1e-9 guard)."""
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x) ** 2


def reference_decode(t: dict[str, torch.Tensor], codes: torch.Tensor, strides=(8, 5, 4, 2, 3)) -> torch.Tensor:
    """codes [T, 8] -> [T * hop] float64, straight from the checkpoint tensors."""
    t = {k: v.double() for k, v in t.items()}
    z = sum(
        t[f"quantizer.quantizers.{i}.codebook.embed"][codes[:, i]] @ t[f"quantizer.quantizers.{i}.project_out.weight"].T
        + t[f"quantizer.quantizers.{i}.project_out.bias"]
        for i in range(codes.shape[1])
    )  # [T, H]
    x = (z @ t["fc2.weight"].T + t["fc2.bias"]).T[None]  # [1, C, T]
    d = "acoustic_decoder."
    x = F.conv1d(x, t[d + "conv1.weight"], t[d + "conv1.bias"], padding=3)
    for i, s in enumerate(strides):
        p = f"{d}block.{i}."
        x = snake(x, t[p + "snake1.alpha"])
        x = F.conv_transpose1d(
            x, t[p + "conv_t1.weight"], t[p + "conv_t1.bias"], stride=s, padding=math.ceil(s / 2), output_padding=s % 2
        )
        for j, dil in ((1, 1), (2, 3), (3, 9)):
            r = f"{p}res_unit{j}."
            y = F.conv1d(snake(x, t[r + "snake1.alpha"]), t[r + "conv1.weight"], t[r + "conv1.bias"], dilation=dil,
                         padding=3 * dil)  # fmt: skip
            x = x + F.conv1d(snake(y, t[r + "snake2.alpha"]), t[r + "conv2.weight"], t[r + "conv2.bias"])
    x = snake(x, t[d + "snake1.alpha"])
    return F.conv1d(x, t[d + "conv2.weight"], t[d + "conv2.bias"], padding=3).reshape(-1)


def decode_tolerance(t: dict[str, torch.Tensor], store: torch.dtype) -> float:
    """Relative error bound of the decoder chain: fp32 accumulation, intermediates stored in ``store``.

    The smaller of two bounds. ``chain_rel_tol`` is the first-order worst case (errors of all roundings in
    one direction); with ~250 roundings it is vacuous in bf16 (0.9). The probabilistic one treats rounding
    errors as independent and mean-zero (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019, Thm 2.4): a
    length-K reduction errs by at most lambda sqrt(K) u, and n roundings by lambda sqrt(n) u, each with
    probability >= 1 - 2 n exp(-lambda^2 / 2); lambda = 6 makes that 1 - 3e-8 n.
    """
    reductions = [64] * 8 + [8, t["fc2.weight"].shape[1]]  # project_out, the 8-term sum, fc2
    roundings = 3  # the RVQ sum, its cast to the decoder dtype, fc2's output
    for key, w in t.items():
        if not key.startswith("acoustic_decoder.") or not key.endswith("weight"):
            continue
        c_in, k = (w.shape[0], 2) if "conv_t" in key else (w.shape[1], w.shape[2])  # a transposed conv: 2 taps
        reductions.append(c_in * k)
        roundings += 1 + ("res_unit" in key and key.endswith("conv2.weight"))  # output (+ the residual add)
    snakes = sum(key.endswith("alpha") for key in t if key.startswith("acoustic_decoder."))
    roundings += 5 * snakes  # mul, sin, square, reciprocal-mul, add
    lam = 6.0
    probable = lam * (
        sum(math.sqrt(k) for k in reductions) * unit_roundoff(torch.float32)
        + math.sqrt(roundings) * unit_roundoff(store)
    )
    return min(chain_rel_tol(reductions, roundings, torch.float32, store), probable)


# ---------------------------------------------------------------------------------------------------------
# names, shapes, configs


def test_checkpoint_holds_the_transformers_layout(tensors) -> None:
    cfg = build_config(TINY_CODEC)
    layout = expected_shapes(cfg, encoder=True) | unused_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == layout
    assert len(layout) == 351 and all(v.dtype == torch.bfloat16 for v in tensors.values())
    assert set(expected_shapes(cfg, encoder=False)) < set(expected_shapes(cfg, encoder=True))


@pytest.mark.parametrize("name", ["tiny", "4b"])
def test_layout_equals_transformers_state_dict(name: str) -> None:
    model_class = transformers_codec_class()
    cfg = build_config(TINY_CODEC if name == "tiny" else HIGGS_V3_CODEC)
    with torch.device("meta"):
        theirs = {k: tuple(v.shape) for k, v in model_class(cfg).state_dict().items()}
    ours = expected_shapes(cfg, encoder=True) | unused_shapes(cfg)
    assert ours == theirs
    assert len(theirs) == (351 if name == "tiny" else 527)  # 527: SPEC_codec 2's inventory of the 4B codec


def test_4b_constants_give_the_real_shapes() -> None:
    """SPEC_codec 2: the decoder-side shapes of the 4B codec and its derived sizes."""
    cfg = build_config(HIGGS_V3_CODEC)
    shapes = expected_shapes(cfg, encoder=True)
    assert shapes["acoustic_decoder.conv1.weight"] == (1024, 256, 7)
    assert shapes["acoustic_decoder.block.0.conv_t1.weight"] == (1024, 512, 16)
    assert shapes["acoustic_decoder.conv2.weight"] == (1, 32, 7)
    assert shapes["acoustic_encoder.conv1.weight"] == (64, 1, 7)
    assert shapes["acoustic_encoder.conv2.weight"] == (256, 2048, 3)
    assert shapes["fc2.weight"] == (256, 1024) and shapes["quantizer.quantizers.7.project_out.weight"] == (1024, 64)
    assert unused_shapes(cfg)["fc1.weight"] == (768, 1024)
    decode = expected_shapes(cfg, encoder=False)
    values = sum(math.prod(s) for s in decode.values())
    assert len([k for k in decode if k.startswith("acoustic_decoder.")]) == 110
    assert round(values / 1e6, 2) == 21.56  # SPEC_codec 2: decoding needs 21.56M values
    with torch.device("meta"):
        model = CodecModel(cfg, encoder=False)
    s = model.spec
    assert (s.hop_length, s.frame_rate, s.num_quantizers, s.hidden_size, s.semantic_downsample) == (960, 25, 8, 1024, 2)


def test_config_round_trips_through_json(tmp_path: Path) -> None:
    for raw in (TINY_CODEC, HIGGS_V3_CODEC):
        d = config_to_dict(build_config(raw))
        (tmp_path / "c.json").write_text(json.dumps(d))
        assert config_to_dict(build_config(json.loads((tmp_path / "c.json").read_text()))) == d
        assert d["acoustic_model_config"]["upsampling_ratios"] == [8, 5, 4, 2, 3]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: c.pop("target_bandwidths"), "target_bandwidths"),
        (lambda c: c.pop("acoustic_model_config"), "acoustic_model_config"),
        (lambda c: c.update(model_type="dac"), "model_type"),
        (lambda c: c["acoustic_model_config"].update(upsampling_ratios=[8, 5, 4, 2]), "960"),
        (lambda c: c.update(sample_rate=22050), "22050"),
        (lambda c: c.update(target_bandwidths=[0.1]), "quantizer"),
        (lambda c: c["semantic_model_config"].update(model_type="wav2vec2"), "hubert"),
    ],
)
def test_bad_codec_config_is_refused(change, match: str) -> None:
    raw = json.loads(json.dumps(TINY_CODEC))
    change(raw)
    with pytest.raises(ValueError, match=match):
        build_config(raw)


def test_tiny_talker_tensors_are_recipe_1s() -> None:
    """Recipe 2 draws the codec from its own generator: the talker's tensors are bit-identical to recipe 1's."""
    weights = tiny_weights(tiny_config())
    talker = sorted(k for k in weights if not k.startswith(CODEC_PREFIX))
    digest = hashlib.sha256()
    for k in talker:
        digest.update(k.encode())
        digest.update(weights[k].contiguous().numpy().tobytes())
    assert digest.hexdigest() == "f59e32f59259da861bfd52331fdc2bd95ecc043682a5723f8a769dd181f54c8f"  # recipe 1
    assert sorted(tiny_weights(tiny_config(), codec=False)) == talker and len(weights) - len(talker) == 351


# ---------------------------------------------------------------------------------------------------------
# decoding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_float64_recomputation(dtype, codec, codec_bf16, tensors) -> None:
    c = codec if dtype == torch.float32 else codec_bf16
    codes = random_codes(30)
    got, want = c.decode(codes), reference_decode(tensors, codes)
    assert got.dtype == torch.float32 and got.shape == (30 * HOP,)
    tol = decode_tolerance(tensors, dtype)
    err = rel_err(got, want)
    assert err <= tol, f"{dtype}: relative error {err:.3g} above the chain bound {tol:.3g}"
    other = reference_decode(tensors, random_codes(30, seed=1))
    assert rel_err(got, other) > 2 * tol  # the bound is below what a wrong decode gives


def transformers_codec(tensors: dict[str, torch.Tensor]):
    """transformers' HiggsAudioV2TokenizerModel for the tiny config, holding the checkpoint's tensors in fp32."""
    hf = transformers_codec_class()(build_config(TINY_CODEC)).eval()
    hf.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    return hf


def check_decode_against_transformers(ours: Codec, hf, codes: torch.Tensor, tol: float) -> None:
    """ours.decode(codes [T, 8]) is bit-identical to transformers' modules fed upstream's RVQ-sum layout and within
    ``tol`` of ``HiggsAudioV2TokenizerModel.decode`` (whose fc2 input rounds differently, SPEC_codec 3.8)."""
    with torch.no_grad():
        theirs = hf.decode(codes.t()[None], return_dict=False)[0, 0]
        summed = hf.quantizer.decode(codes.t()[:, None]).contiguous()  # [B, H, T], as upstream holds it
        upstream = hf.acoustic_decoder(hf.fc2(summed.transpose(1, 2)).transpose(1, 2))[0, 0]
    got = ours.decode(codes)
    assert got.shape == upstream.shape == theirs.shape
    assert torch.equal(got, upstream), f"differs from transformers' modules by {rel_err(got, upstream):.3g} relative"
    err = rel_err(got, theirs)
    assert err <= tol, f"relative error {err:.3g} to HiggsAudioV2TokenizerModel.decode, above {tol:.3g}"


def test_decode_matches_transformers(tensors, codec) -> None:
    """Runs without torchaudio (see ``transformers_codec_class``)."""
    tol = 2 * decode_tolerance(tensors, torch.float32)  # both sides err from the exact decode by one fp32 chain
    check_decode_against_transformers(codec, transformers_codec(tensors), random_codes(40, seed=2), tol)


def _swap_codebooks(model: CodecModel) -> None:
    q = model.quantizer.quantizers
    q[0].codebook.embed, q[1].codebook.embed = q[1].codebook.embed, q[0].codebook.embed


def _nudge_one_weight(model: CodecModel) -> None:
    w = model.acoustic_decoder.block[2].res_unit2.conv1.weight
    w.data[3, 1, 4] *= 1 + 2**-10  # one of the decoder's 20k weights, by 1e-3 relative


@pytest.mark.parametrize(("mutate", "within_tol"), [(_swap_codebooks, False), (_nudge_one_weight, True)])
def test_transformers_comparison_catches_a_wrong_decoder(mutate, within_tol: bool, tiny_dir: Path, tensors) -> None:
    """The decode comparison fails for a codec one defect away from transformers'."""
    wrong = Codec.from_pretrained(tiny_dir)
    mutate(wrong.model)
    tol = 2 * decode_tolerance(tensors, torch.float32)
    with pytest.raises(AssertionError, match="differs from transformers' modules"):
        check_decode_against_transformers(wrong, transformers_codec(tensors), random_codes(40, seed=2), tol)
    # a defect this small hides inside the rounding bound of the unequal layout; only the bit-identity sees it
    codes = random_codes(40, seed=2)
    with torch.no_grad():
        theirs = transformers_codec(tensors).decode(codes.t()[None], return_dict=False)[0, 0]
    assert (rel_err(wrong.decode(codes), theirs) <= tol) == within_tol


def test_decode_of_no_frames_is_empty(codec) -> None:
    assert codec.decode(torch.zeros(0, 8, dtype=torch.long)).shape == (0,)


@pytest.mark.parametrize(
    ("codes", "error", "match"),
    [
        (torch.full((4, 8), 1024), ValueError, "1024"),
        (torch.full((4, 8), -1), ValueError, "-1"),
        (torch.zeros(4, 7, dtype=torch.long), ValueError, r"\[4, 7\]"),
        (torch.zeros(8, dtype=torch.long), ValueError, r"\[8\]"),
        (torch.zeros(1, 4, 8, dtype=torch.long), ValueError, r"\[1, 4, 8\]"),
        (torch.zeros(4, 8), TypeError, "float32"),
        (np.zeros((4, 8), np.float64), TypeError, "float64"),
        (torch.zeros(4, 8, dtype=torch.bool), TypeError, "bool"),
        ([[0] * 8], TypeError, "list"),
    ],
)
def test_bad_codes_are_refused(codes, error, match, codec) -> None:
    with pytest.raises(error, match=match):
        codec.decode(codes)


def test_integer_codes_of_any_width_decode_alike(codec) -> None:
    codes = random_codes(6)
    want = codec.decode(codes)
    assert torch.equal(codec.decode(codes.int()), want)
    assert torch.equal(codec.decode(codes.numpy().astype(np.uint16)), want)


# ---------------------------------------------------------------------------------------------------------
# the receptive field and streaming


def test_decoder_reach_matches_a_perturbation(tensors, codec) -> None:
    """Changing frame f's codes changes exactly the samples of frames f - 10 .. f + 10 (float64, tiny)."""
    codes = random_codes(41, seed=3)
    f = 20
    other = codes.clone()
    other[f] = (other[f] + 517) % 1024
    diff = (reference_decode(tensors, codes) - reference_decode(tensors, other)).abs().reshape(-1, HOP).amax(1)
    changed = torch.nonzero(diff > 0).flatten()
    reach = (f - int(changed.min()), int(changed.max()) - f)
    assert reach == codec.context_frames == (10, 10)


def test_4b_decoder_has_the_same_reach() -> None:
    with torch.device("meta"):
        model = CodecModel(build_config(HIGGS_V3_CODEC), encoder=False)
    assert decoder_reach(model.acoustic_decoder, 960) == (10, 10)


def test_schedule_reproduces_upstream() -> None:
    """SPEC_codec 4.3: 137 frames under upstream's 25/25/4/1 rule, frames arriving one talker row at a time."""
    rule = UPSTREAM_CHUNKING
    emitted, log = 0, []
    for rows in range(1, 146):
        finished = rows == 145
        available = 137 if finished else max(0, rows - 7)  # upstream counts frames as rows - 7
        w = next_window(available, emitted, finished, rule)
        if w is not None:
            log.append((rows - 1, w.end - w.start, w.emit_start - w.start, w.end - w.emit_end, w.emit_end - emitted))
            emitted = w.emit_end
    assert log == [
        (11, 5, 0, 4, 1),
        (36, 30, 1, 4, 25),
        (61, 54, 25, 4, 25),
        (86, 54, 25, 4, 25),
        (111, 54, 25, 4, 25),
        (136, 54, 25, 4, 25),
        (144, 36, 25, 0, 11),
    ]
    assert emitted == 137


def stream(codec: Codec, codes: torch.Tensor, chunking: AudioChunking | None, step: int = 1) -> list[torch.Tensor]:
    decoder = codec.stream(chunking)
    chunks = [decoder.push(codes[i : i + step]) for i in range(0, codes.shape[0], step)]
    return [c for c in [*chunks, decoder.finish()] if c is not None]


@pytest.mark.parametrize(
    ("chunking", "step"),
    [
        (None, 1),  # the default: chunks of 1, 1, 2, 4, 8, 16, then 25, context = the codec's reach
        (AudioChunking(ramp=False), 1),  # chunks of 25 after a first one of 1
        (AudioChunking(chunk_frames=7, first_chunk_frames=3, left_context_frames=12, holdback_frames=10), 1),
        (AudioChunking(chunk_frames=5, first_chunk_frames=5), 4),  # frames arriving four at a time
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streaming_equals_one_shot(chunking, step, dtype, codec, codec_bf16, tensors) -> None:
    c = codec if dtype == torch.float32 else codec_bf16
    codes = random_codes(57, seed=4)
    chunks = stream(c, codes, chunking, step)
    whole = c.decode(codes)
    assert c.stream(chunking).exact and len(chunks) > 2
    assert sum(x.shape[0] for x in chunks) == whole.shape[0]
    tol = 2 * decode_tolerance(tensors, dtype)  # two evaluations of the same chain
    start = 0
    for x in chunks:
        assert x.shape[0] % HOP == 0
        err = rel_err(x, whole[start : start + x.shape[0]])
        assert err <= tol, f"chunk at frame {start // HOP}: {err:.3g} > {tol:.3g}"
        start += x.shape[0]


def test_upstream_chunking_differs_where_its_holdback_is_short(codec, tensors) -> None:
    """Holdback 4 < the 10-frame reach: the last ~6 frames before each chunk end differ (SPEC_codec 4.4)."""
    codes = random_codes(81, seed=5)
    chunks = stream(codec, codes, UPSTREAM_CHUNKING)
    assert not codec.stream(UPSTREAM_CHUNKING).exact
    assert [x.shape[0] // HOP for x in chunks] == [1, 25, 25, 25, 5]
    whole = codec.decode(codes).reshape(-1, HOP)
    got = torch.cat(chunks).reshape(-1, HOP)
    err = ((got - whole).norm(dim=1) / whole.norm(dim=1)).tolist()
    tol = 2 * decode_tolerance(tensors, torch.float32)
    bad = {f for f, e in enumerate(err) if e > tol}
    assert bad, "upstream's holdback gave exact audio: the exactness test above would prove nothing"
    ends = [1, 26, 51, 76]  # frames where non-final chunks end
    assert bad <= {f for end in ends for f in range(end - 7, end)}
    assert {0, 25, 50, 75} <= bad  # the last frame before each cut has the least future context


def test_fast_start_sends_its_first_frames_at_once_and_every_later_chunk_exact(codec, tensors) -> None:
    """``FAST_START_CHUNKING``: the first chunk (3 frames) comes with the third frame, decoded without its future
    context, so it differs from one-shot audio (most at its end); every later chunk holds back the codec's reach
    and equals one-shot audio, each as long as the audio sent before it up to 25 frames (the ramp). A first
    holdback of the reach is exact again."""
    codes = random_codes(81, seed=6)
    decoder = codec.stream(FAST_START_CHUNKING)
    pushed = [decoder.push(codes[i]) for i in range(codes.shape[0])]
    chunks = [c for c in [*pushed, decoder.finish()] if c is not None]
    assert [i for i, c in enumerate(pushed) if c is not None] == [2, 15, 21, 33, 57]  # frame 16 = 3 + 3 + 10, ...
    assert [c.shape[0] // HOP for c in chunks] == [3, 3, 6, 12, 24, 33] and not decoder.exact
    whole = codec.decode(codes)
    tol = 2 * decode_tolerance(tensors, torch.float32)
    per_frame = [rel_err(g, w) for g, w in zip(chunks[0].reshape(-1, HOP), whole.reshape(-1, HOP), strict=False)]
    assert per_frame[2] > 100 * tol, per_frame  # the last frame of the first chunk: no future context
    rest = torch.cat(chunks[1:])
    assert rel_err(rest, whole[3 * HOP :]) <= tol
    assert codec.stream(AudioChunking(first_chunk_frames=3, first_holdback_frames=10)).exact


def _player_wait_ms(rule: AudioChunking, step_ms: float, frames: int = 400) -> float:
    """How long a player that starts with the first chunk waits for audio afterwards, where the talker makes a frame
    every ``step_ms`` and decoding takes no time (40 ms of audio a frame)."""
    rule, emitted, play_end, waited = rule.resolved((10, 10)), 0, None, 0.0
    for available in range(1, frames + 1):
        window = next_window(available, emitted, available == frames, rule)
        if window is not None:
            now = available * step_ms
            waited += 0.0 if play_end is None else max(0.0, now - play_end)
            play_end = max(now, play_end or now) + 40.0 * (window.emit_end - emitted)
            emitted = window.emit_end
    return waited


def test_ramped_chunks_never_starve_a_player_while_the_talker_runs_twice_real_time():
    """Each ramped chunk is as long as the audio sent before it (1, 1, 2, 4, 8, 16, then 25 frames), so a player
    never waits while a frame takes under 20 ms (half of its 40 ms of audio); without the ramp a one-frame first
    chunk plays out before the next 25 frames exist, so it waits wherever a frame takes over 1.6 ms (25 in 40 ms):
    32.5 ms at 2.9 ms a step (the H200's one stream)."""
    assert [chunk_due(e, AudioChunking()) for e in (0, 1, 2, 4, 8, 16, 32, 57)] == [1, 1, 2, 4, 8, 16, 25, 25]
    assert [chunk_due(e, AudioChunking(first_chunk_frames=3)) for e in (0, 1, 3, 6)] == [3, 3, 3, 6]
    assert chunk_due(7, AudioChunking(ramp=False)) == 25 and chunk_due(0, AudioChunking(ramp=False)) == 1
    # the hand-over's rule (vllm-omni's connector settings: a first chunk of 0, or longer than the rest, is the rest's)
    ours = {"codec_left_context_frames": 10, "codec_right_holdback_frames": 10, "initial_codec_chunk_frames": 1}
    want = AudioChunking(left_context_frames=10, holdback_frames=10)
    assert connector_rule(ours | {"codec_chunk_ramp": True}) == want
    assert connector_rule(ours) is connector_rule(dict(ours)) and not connector_rule(ours).ramp
    assert connector_rule({}) == AudioChunking(25, 25, 25, 4, ramp=False)  # upstream's defaults: no first chunk
    for first in (0, 10, 40):
        want = AudioChunking(10, 10, 25, 4, ramp=False)
        assert connector_rule({"codec_chunk_frames": 10, "initial_codec_chunk_frames": first}) == want
    for bad in ({"codec_chunk_frames": 0}, {"codec_left_context_frames": -1}, {"codec_chunk_frames": "many"}):
        with pytest.raises(ValueError, match="connector's extras"):
            connector_rule(bad)
    for step_ms in (0.5, 2.9, 10.0, 19.0):
        for rule in (AudioChunking(), AudioChunking(chunk_frames=40, first_chunk_frames=2)):
            assert _player_wait_ms(rule, step_ms) == 0.0, (rule, step_ms)
    # fast start's first 3 frames (120 ms) cover the 13 frames its second chunk needs (3 and the holdback of 10)
    # up to 9.2 ms a frame; past that the ramp again
    assert [_player_wait_ms(FAST_START_CHUNKING, ms) for ms in (0.5, 2.9, 9.0, 10.0)] == [0.0, 0.0, 0.0, 10.0]
    assert _player_wait_ms(AudioChunking(ramp=False), 2.9) == pytest.approx(25 * 2.9 - 40.0)
    assert _player_wait_ms(AudioChunking(ramp=False), 1.5) == 0.0
    assert _player_wait_ms(AudioChunking(), 30.0) > 0.0  # slower than twice real time: the ramp cannot keep up


@pytest.mark.parametrize("rule", [AudioChunking(), UPSTREAM_CHUNKING, FAST_START_CHUNKING,
                                  AudioChunking(chunk_frames=7, first_chunk_frames=2, left_context_frames=3,
                                                holdback_frames=1, first_holdback_frames=5)])  # fmt: skip
def test_frames_wanted_is_the_push_that_makes_the_next_chunk_due(codec, rule) -> None:
    """``frames_wanted()`` (what a streamed request's thread waits for before it wakes): a push of that many frames
    returns the next chunk, a push one frame short returns none, for upstream's cut, the ramp and odd rules."""
    decoder, codes, sent = codec.stream(rule), torch.randint(0, 1024, (300, 8)), 0
    while sent < 250:
        want = decoder.frames_wanted()
        assert want >= 1
        if want > 1:
            assert decoder.push(codes[sent : sent + want - 1]) is None, (sent, want)
            sent += want - 1
            assert decoder.frames_wanted() == 1
        assert decoder.push(codes[sent : sent + 1]) is not None, sent
        sent += 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(ramp=1), "ramp"),
        (dict(chunk_frames=0), "chunk_frames"),
        (dict(first_chunk_frames=30), "first_chunk_frames"),
        (dict(holdback_frames=-1), "holdback_frames"),
        (dict(left_context_frames=2.5), "left_context_frames"),
        (dict(first_holdback_frames=-1), "first_holdback_frames"),
    ],
)
def test_bad_chunking_is_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        AudioChunking(**kwargs)


def test_unset_context_sizes_take_the_codecs_reach_before_and_after() -> None:
    """Left context covers the frames before (reach[0]), the holdback the frames after (reach[1]): an asymmetric
    reach shows which is which (the real codec's is (10, 10))."""
    assert AudioChunking().resolved((3, 7)) == AudioChunking(25, 1, 3, 7, 7)
    assert AudioChunking(left_context_frames=2).resolved((3, 7)) == AudioChunking(25, 1, 2, 7, 7)
    assert AudioChunking(holdback_frames=0).resolved((3, 7)) == AudioChunking(25, 1, 3, 0, 0)  # the first's too
    assert AudioChunking(first_holdback_frames=2).resolved((3, 7)) == AudioChunking(25, 1, 3, 7, 2)


def test_finished_stream_refuses_frames(codec) -> None:
    decoder = codec.stream()
    decoder.push(random_codes(3))
    assert decoder.finish().shape == (3 * HOP,) and decoder.finish() is None
    with pytest.raises(ValueError, match="finished"):
        decoder.push(random_codes(1))


def _gated_decoder(codec: Codec, monkeypatch) -> tuple[threading.Event, list[int]]:
    """Hold the codec's first decode until the returned event is set; record each decode's batch size."""
    gate, sizes, real = threading.Event(), [], codec.model.decode

    def decode(codes):
        sizes.append(codes.shape[0])
        if len(sizes) == 1:
            assert gate.wait(30), "the test never opened the gate"
        return real(codes)

    monkeypatch.setattr(codec.model, "decode", decode)
    return gate, sizes


def _first_then_queued(codec: Codec, gate: threading.Event, sizes: list[int], run, ids: list[int]) -> None:
    """``run(ids[0])`` on a thread until its decode is held at ``gate``, then ``run`` of the rest on threads until
    their windows are queued behind it; then open the gate and wait for all."""
    first = threading.Thread(target=run, args=(ids[0],))
    first.start()
    while not sizes:
        time.sleep(0.001)
    rest = [threading.Thread(target=run, args=(i,)) for i in ids[1:]]
    for t in rest:
        t.start()
    for _ in range(3000):
        with codec.windows._lock:
            if len(codec.windows._queue) >= len(rest):
                break
        time.sleep(0.001)
    else:
        raise AssertionError(f"{len(rest)} windows never queued")
    gate.set()
    for t in [first, *rest]:
        t.join(30)


def test_windows_queued_during_a_decode_are_decoded_together(codec, tensors, monkeypatch) -> None:
    """Streams whose windows arrive while another stream decodes share the next decode (one batch), and each
    gets what its window decodes to alone; streams of another window length decode beside them, not padded."""
    windows = [(random_codes(n, seed=20 + i), 3, 2) for i, n in enumerate([30, 30, 30, 30, 17])]
    alone = [codec.decode(c)[3 * HOP : (c.shape[0] - 2) * HOP] for c, _, _ in windows]
    gate, sizes = _gated_decoder(codec, monkeypatch)
    got: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        got[i] = codec.windows.decode(*windows[i])

    _first_then_queued(codec, gate, sizes, run, [0, 1, 2, 3, 4])
    assert sorted(sizes) == [1, 1, 3], sizes  # the first alone, then the 30-frame three together, the 17 alone
    tol = 2 * decode_tolerance(tensors, torch.float32)
    for i, want in enumerate(alone):
        assert got[i].shape == want.shape and rel_err(got[i], want) <= tol, i


def test_a_stream_gone_while_woken_to_run_the_queue_hands_it_on(codec, monkeypatch) -> None:
    """The batcher wakes only the streams a decode served, and the oldest queued one to run the next decode. Where
    that stream is gone (Ctrl-C in its wait: ``_leave``), the next queued stream runs the queue instead of every
    queued stream waiting for ever; and the gone stream's window is not decoded."""
    from higgs_talker.codec.streaming import _Pending

    gate, sizes = _gated_decoder(codec, monkeypatch)
    batcher, got = codec.windows, {}
    first = threading.Thread(
        target=lambda: got.setdefault(0, batcher.decode(random_codes(12, seed=0), 0, 0)), daemon=True
    )
    first.start()
    while not sizes:
        time.sleep(0.001)
    gone = _Pending((random_codes(12, seed=1), 0, 0))
    with batcher._lock:
        batcher._queue.append(gone)  # a stream that queued its window and waits
    last = threading.Thread(
        target=lambda: got.setdefault(2, batcher.decode(random_codes(12, seed=2), 0, 0)), daemon=True
    )
    last.start()
    while len(batcher._queue) < 2:
        time.sleep(0.001)
    gate.set()
    assert gone.woken.wait(30) and not gone.done  # woken to run the queue, its window among it
    batcher._leave(gone)  # ... but it is gone
    last.join(30)
    first.join(30)
    assert sorted(got) == [0, 2] and not gone.done and gone.result is None
    assert sizes == [1, 1], sizes  # the first alone, then the last stream's window alone (the gone one left)
    assert torch.equal(got[2], codec.decode(random_codes(12, seed=2)))
    assert batcher.decode(random_codes(12, seed=3), 0, 0).shape == (12 * HOP,) and not batcher._running


def test_a_stream_that_leaves_after_it_was_chosen_and_before_it_was_woken_hands_the_queue_on(codec) -> None:
    """A decode's end chooses the next runner under the lock and wakes it after: a stream leaving in between (its
    wake-up not yet set) must still hand the queue on, else every queued stream waits for ever."""
    from higgs_talker.codec.streaming import WindowBatcher, _Pending

    batcher = WindowBatcher(codec)  # its own: the state left here is no other test's
    gone, other = _Pending((random_codes(12, seed=1), 0, 0)), _Pending((random_codes(12, seed=2), 0, 0))
    with batcher._lock:
        batcher._queue += [gone, other]
        batcher._running = True
        assert batcher._next_runner() is gone  # a decode ended and chose it; its wake-up comes after the lock
    batcher._leave(gone)
    assert other.woken.is_set() and other.leads and batcher._queue == [other] and batcher._running


def test_a_failed_batch_is_decoded_again_window_by_window_and_only_the_bad_window_fails(codec, monkeypatch) -> None:
    """A decode that raises for one window of a batch (here: any window 13 frames long) does not take the other
    streams of the batch with it: the batch is decoded again one window at a time, and only that window's stream
    gets the error; the batcher then decodes as before."""
    gate, sizes = _gated_decoder(codec, monkeypatch)
    gated = codec.model.decode

    def failing(codes):
        if codes.shape[-1] == 13:
            raise RuntimeError("decode failed (simulated)")
        return gated(codes)

    monkeypatch.setattr(codec.model, "decode", failing)
    windows = {0: random_codes(12, seed=0), 1: random_codes(12, seed=1), 2: random_codes(13, seed=2)}
    got: dict[int, torch.Tensor] = {}
    errors: dict[int, BaseException] = {}

    def run(i: int) -> None:
        try:
            got[i] = codec.windows.decode(windows[i], 0, 0)
        except RuntimeError as exc:
            errors[i] = exc

    _first_then_queued(codec, gate, sizes, run, [0, 1, 2])
    assert list(errors) == [2] and "simulated" in str(errors[2]), errors
    assert sorted(got) == [0, 1]
    assert torch.equal(got[1], codec.decode(windows[1]))  # decoded alone on the retry: the lone decode exactly
    assert codec.windows.decode(random_codes(12, seed=9), 0, 0).shape == (12 * HOP,)  # the batcher still works


def test_concurrent_streams_each_equal_their_one_shot_audio(codec, tensors) -> None:
    """Eight streams pushing frames from eight threads at once (their windows batched as they meet): each
    stream's chunks equal its own one-shot decode."""
    codes = [random_codes(40 + 3 * i, seed=30 + i) for i in range(8)]
    out: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        out[i] = torch.cat(stream(codec, codes[i], None))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    tol = 2 * decode_tolerance(tensors, torch.float32)
    for i in range(8):
        whole = codec.decode(codes[i])
        assert out[i].shape == whole.shape and rel_err(out[i], whole) <= tol, i


# ---------------------------------------------------------------------------------------------------------
# resampling and encoding


def reference_resample(x: torch.Tensor, orig: int, new: int) -> torch.Tensor:
    """Direct float64 evaluation: y[j] = sum_i x[i] h(i / a - j / b), h the Hann-windowed sinc of torchaudio."""
    g = math.gcd(orig, new)
    a, b = orig // g, new // g
    cutoff = 0.99 * min(a, b)
    i = torch.arange(x.shape[-1], dtype=torch.float64)
    j = torch.arange(-(-x.shape[-1] * b // a), dtype=torch.float64)
    t = ((i[None, :] / a - j[:, None] / b) * cutoff).clamp(-6, 6)
    h = torch.sinc(t) * torch.cos(t * math.pi / 12) ** 2 * cutoff / a
    return h @ x.double(), h


@pytest.mark.parametrize(("orig", "new"), [(24000, 16000), (16000, 24000), (22050, 24000), (48000, 24000)])
def test_resample_matches_the_interpolation_formula(orig: int, new: int) -> None:
    x = torch.randn(700, generator=torch.Generator().manual_seed(orig))
    got = resample(x, orig, new)
    want, h = reference_resample(x, orig, new)
    assert got.shape == want.shape
    taps = int((h != 0).sum(1).max())
    # a dot product of `taps` terms in fp32, taps rounded once to fp32, the output rounded once
    bound = (gamma(taps, torch.float32) + 2 * unit_roundoff(torch.float32)) * (h.abs() @ x.double().abs())
    assert bool(((got.double() - want).abs() <= bound).all())


def test_resample_matches_torchaudio() -> None:
    """Against torchaudio itself: skips where torchaudio does not import (CI's CPU torch)."""
    torchaudio = torchaudio_or_skip()
    for orig in (16000, 22050, 44100, 48000):
        x = torch.randn(2, 5000, dtype=torch.float64, generator=torch.Generator().manual_seed(orig))
        theirs = torchaudio.functional.resample(x, orig, 24000)
        assert rel_err(resample(x, orig, 24000), theirs) < 1e-12  # the same filter (float64 on both sides)


@pytest.mark.parametrize("samples", [24000, 24001, 24479, 36123, 48000])
def test_encode_lengths_and_round_trip(samples: int, codec) -> None:
    wav = 0.1 * torch.randn(samples, generator=torch.Generator().manual_seed(samples))
    codes = codec.encode(wav, 24000)
    frames = codec.frames_for(samples)
    assert frames == math.ceil((math.floor((math.ceil(2 * samples / 3) - 80) / 320) + 1) / 2)  # SPEC_codec 5.4
    assert codes.shape == (frames, 8) and codes.dtype == torch.int64
    assert int(codes.min()) >= 0 and int(codes.max()) < 1024
    assert codec.decode(codes).shape == (frames * HOP,)
    assert {codec.frames_for(s * 24000) for s in (1, 2, 30)} == {25, 50, 750}


def test_encode_mixes_channels_and_resamples(codec) -> None:
    g = torch.Generator().manual_seed(9)
    left, right = 0.1 * torch.randn(16000, generator=g), 0.1 * torch.randn(16000, generator=g)
    stereo = codec.encode(torch.stack([left, right]), 16000)
    mono = codec.encode(resample((left + right) / 2, 16000, 24000), 24000)
    assert torch.equal(stereo, mono) and stereo.shape == (25, 8)


@pytest.mark.parametrize("rate", [24000, 16000])
def test_encode_matches_transformers(rate: int, tensors, codec) -> None:
    """transformers' encode resamples with torchaudio (to 16 kHz for HuBERT, always): skips where torchaudio does
    not import (CI's CPU torch)."""
    torchaudio = torchaudio_or_skip()
    model_class = transformers_codec_class()
    hf = model_class(build_config(TINY_CODEC)).eval()
    hf.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    wav = 0.1 * torch.randn(2 * rate, generator=torch.Generator().manual_seed(rate))
    with torch.no_grad():  # upstream: torchaudio resampling to 24 kHz, then the model (SPEC_codec 5.2)
        theirs = hf.encode(torchaudio.functional.resample(wav, rate, 24000)[None, None], return_dict=False)[0].t()
    assert torch.equal(codec.encode(wav, rate), theirs)


@pytest.mark.parametrize(
    ("audio", "rate", "error", "match"),
    [
        (torch.zeros(0), 24000, ValueError, "empty"),
        (torch.full((24000,), float("nan")), 24000, ValueError, "non-finite"),
        (torch.zeros(2, 2, 24000), 24000, ValueError, r"\[2, 2, 24000\]"),
        (torch.zeros(24000, 2), 24000, ValueError, r"\[24000, 2\]"),
        (torch.zeros(24000), 10, ValueError, "10 Hz"),
        (torch.zeros(24000), 10**7, ValueError, "10000000 Hz"),
        (torch.zeros(24000), 24000.0, TypeError, "24000.0"),
        (torch.zeros(24000, dtype=torch.bool), 24000, TypeError, "bool"),
        (np.zeros(24000, np.int16), 24000, TypeError, "int16"),
        (np.array(["a"] * 100), 24000, TypeError, "<U1"),
        ("ref.wav", 24000, TypeError, "str"),
        (torch.zeros(100), 24000, ValueError, "too short"),
    ],
)
def test_bad_audio_is_refused(audio, rate, error, match, codec) -> None:
    with pytest.raises(error, match=match):
        codec.encode(audio, rate)


def test_decode_only_codec_refuses_to_encode(codec_bf16) -> None:
    with pytest.raises(ValueError, match="decoding only"):
        codec_bf16.encode(torch.zeros(24000), 24000)


# ---------------------------------------------------------------------------------------------------------
# loading


def write_codec_dir(tmp_path: Path, tensors: dict[str, torch.Tensor], prefix: str = CODEC_PREFIX) -> Path:
    """A checkpoint directory holding only (prefixed) codec tensors and the tiny codec config."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    config = config_to_dict(build_config(TINY_CODEC))
    if prefix:
        (tmp_path / CODEC_CONFIG_FILE).write_text(json.dumps(config))
    else:  # transformers' audio tokenizer layout
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_every_problem_of_the_weights_in_one_error(tmp_path: Path, tensors) -> None:
    bad = dict(tensors)
    del bad["acoustic_decoder.conv2.bias"]
    bad["fc3.weight"] = torch.zeros(3)
    bad["fc2.weight"] = torch.zeros(8, 25)
    bad["acoustic_decoder.conv1.bias"] = bad["acoustic_decoder.conv1.bias"].to(torch.int32)
    with pytest.raises(ValueError) as info:
        Codec.from_pretrained(write_codec_dir(tmp_path, bad))
    msg = str(info.value)
    expected = ["1 missing", "acoustic_decoder.conv2.bias", "1 unexpected", "fc3.weight", "1 mis-shaped",
                "fc2.weight [8, 25] (expected [8, 24])", "1 non-float", "conv1.bias (I32)"]  # fmt: skip
    for part in expected:
        assert part in msg, (part, msg)


def test_decode_only_load_needs_only_the_decoder(tmp_path: Path, tensors, codec) -> None:
    cfg = build_config(TINY_CODEC)
    decode_keys = set(expected_shapes(cfg, encoder=False))
    only = {k: v for k, v in tensors.items() if k in decode_keys}
    path = write_codec_dir(tmp_path, only)
    codes = random_codes(5)
    assert torch.equal(Codec.from_pretrained(path).decode(codes), codec.decode(codes))
    with pytest.raises(ValueError, match=r"missing key\(s\): acoustic_encoder"):
        Codec.from_pretrained(path, encoder=True)


def test_a_codebook_under_both_names_is_refused(tmp_path: Path, tensors) -> None:
    both = dict(tensors)
    both["quantizer.quantizers.0.codebook.weight"] = both["quantizer.quantizers.0.codebook.embed"].clone()
    with pytest.raises(ValueError, match=r"both name 'quantizer\.quantizers\.0\.codebook\.embed'"):
        Codec.from_pretrained(write_codec_dir(tmp_path, both))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(tmp_path: Path, tensors, value: float) -> None:
    bad = dict(tensors)
    bad["acoustic_decoder.block.2.conv_t1.weight"] = bad["acoustic_decoder.block.2.conv_t1.weight"].clone()
    bad["acoustic_decoder.block.2.conv_t1.weight"][0, 0, 1] = value
    with pytest.raises(ValueError, match=r"acoustic_decoder\.block\.2\.conv_t1\.weight.* 1 non-finite"):
        Codec.from_pretrained(write_codec_dir(tmp_path, bad))


def test_tokenizer_directory_and_old_names_load(tmp_path: Path, tensors, codec) -> None:
    """transformers' tokenizer layout (unprefixed, config.json), weight_g/weight_v names, masked_spec_embed, and a
    codebook saved as ``codebook.weight`` (upstream's loader takes that name too)."""
    old = dict(tensors)
    pos = "semantic_model.encoder.pos_conv_embed.conv."
    old["quantizer.quantizers.3.codebook.weight"] = old.pop("quantizer.quantizers.3.codebook.embed")
    old[pos + "weight_g"] = old.pop(pos + "parametrizations.weight.original0")
    old[pos + "weight_v"] = old.pop(pos + "parametrizations.weight.original1")
    old["semantic_model.masked_spec_embed"] = torch.zeros(16)
    loaded = Codec.from_pretrained(write_codec_dir(tmp_path, old, prefix=""), encoder=True)
    wav = 0.1 * torch.randn(24000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded.encode(wav, 24000), codec.encode(wav, 24000))
    assert torch.equal(loaded.decode(random_codes(4)), codec.decode(random_codes(4)))


def test_masking_hubert_config_builds_no_mask_embedding() -> None:
    """bosonai's config trains HuBERT with mask_time_prob 0.05; inference builds no masked_spec_embed for it."""
    raw = json.loads(json.dumps(TINY_CODEC))
    raw["semantic_model_config"]["mask_time_prob"] = 0.05
    shapes = expected_shapes(build_config(raw), encoder=True)
    assert shapes == expected_shapes(build_config(TINY_CODEC), encoder=True)


def test_checkpoint_without_codec(make_checkpoint) -> None:
    path = make_checkpoint(codec=False)
    with pytest.raises(ValueError, match="holds no codec"):
        Codec.from_pretrained(path)


def test_broken_codec_config_names_the_file(tmp_path: Path, tiny_dir: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, path)
    (path / CODEC_CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=CODEC_CONFIG_FILE):
        Codec.from_pretrained(path)


def test_from_config_random_weights_decode() -> None:
    c = Codec.from_config(TINY_CODEC, encoder=False, seed=3)
    wav = c.decode(random_codes(10))
    assert wav.shape == (9600,) and 0.01 < float(wav.abs().max()) < 10
    assert not torch.equal(wav, Codec.from_config(TINY_CODEC, encoder=False, seed=4).decode(random_codes(10)))
    assert set(random_tensors(build_config(TINY_CODEC), encoder=False, training_state=False)) == set(
        expected_shapes(build_config(TINY_CODEC), encoder=False)
    )


@pytest.mark.parametrize(("kwargs", "match"), [(dict(dtype="float16"), "float16"), (dict(device="tpu"), "tpu")])
def test_bad_codec_device_or_dtype(tiny_dir: Path, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Codec.from_pretrained(tiny_dir, **kwargs)


def test_import_stays_cheap() -> None:
    """``import higgs_talker`` imports neither the codec nor transformers' DAC/HuBERT code nor torchaudio."""
    code = (
        "import sys, higgs_talker, higgs_talker.audio, higgs_talker.tiny; "
        "print([m for m in ('higgs_talker.codec', 'transformers.models.dac', 'transformers.models.hubert', "
        "'torchaudio') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------------------------------------
# CUDA (skipped without a device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_and_stream_match_float64(tiny_dir: Path, tensors, dtype) -> None:
    # cuDNN runs fp32 convolutions in TF32 by default; the fp32 bound assumes fp32 arithmetic
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        c = Codec.from_pretrained(tiny_dir, device="cuda", dtype=dtype)
        codes = random_codes(57, seed=6)
        whole = c.decode(codes)
        chunks = stream(c, codes, None)
    assert whole.device.type == "cuda" and whole.dtype == torch.float32
    tol = decode_tolerance(tensors, dtype)
    assert rel_err(whole.cpu(), reference_decode(tensors, codes)) <= tol
    assert rel_err(torch.cat(chunks).cpu(), whole.cpu()) <= 2 * tol


@pytest.mark.gpu
def test_streamed_decodes_do_not_wait_behind_the_default_stream(tiny_dir: Path) -> None:
    """A streamed window decode runs on the codec's own stream and comes back on the host while the default stream
    (where a talker queues its steps) is still busy: a spin kernel of about a second is still running when the
    chunk is back, and the chunk equals the same window decoded on the default stream afterwards."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        c = Codec.from_pretrained(tiny_dir, device="cuda")
        codes = random_codes(20, seed=12)
        c.decode_windows_to_host([(codes, 2, 3)])  # the stream exists and cuDNN picked its kernels
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles on the default stream
        got = c.decode_windows_to_host([(codes, 2, 3)])[0]
        busy = not torch.cuda.current_stream().query()
        want = c.decode_windows([(codes, 2, 3)])[0].cpu()
    assert busy, "the decode waited for the default stream's queued work"
    assert got.device.type == "cpu" and torch.equal(got, want)


@pytest.mark.gpu
def test_cuda_encode_agrees_with_cpu(tiny_dir: Path, codec) -> None:
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        c = Codec.from_pretrained(tiny_dir, device="cuda", encoder=True)
        wav = 0.1 * torch.randn(2 * 16000, generator=torch.Generator().manual_seed(8))
        got = c.encode(wav, 16000)
    want = codec.encode(wav, 16000)
    assert got.shape == want.shape == (50, 8) and got.device.type == "cpu"
    # fp32 rounding differs between the CPU and CUDA kernels; a code flips only at a near-tie of two
    # codebook distances (and then changes the residual of the later stages of that frame)
    assert (got == want).float().mean() >= 0.95


@pytest.mark.parametrize(
    "shape",
    [
        dict(num_codebooks=4),
        dict(num_codebooks=12, codebook_size=2050, boc_id=2048, eoc_id=2049),
        dict(num_codebooks=1),
    ],
    ids=["4x1026", "12x2050", "1x1026"],
)
def test_a_built_checkpoint_of_another_codebook_shape_bundles_a_codec_that_fits_it(tmp_path, shape):
    """``tiny.write_checkpoint`` sizes its codec for the talker's codes (one quantizer per codebook, of its real
    codes), so a checkpoint of another shape loads with its codec and speaks: hop 960 samples a frame."""
    from higgs_talker import HiggsTalker
    from higgs_talker.tiny import tiny_config, write_checkpoint

    cfg = tiny_config(**shape)
    talker = HiggsTalker.from_pretrained(write_checkpoint(tmp_path / "ckpt", cfg, eoc_bias=1.5), max_num_seqs=1)
    result = talker.generate("Hello there.", max_frames=12)
    assert result.codes.shape[1] == cfg.num_codebooks and result.num_frames > 0
    assert result.audio.shape == (result.num_frames * 960,) and torch.isfinite(result.audio).all()
    assert int(result.codes.max()) < cfg.num_real_codes


def test_decode_by_length_batches_one_length_together_and_leaves_a_failed_batch_to_be_decoded_alone():
    """``decode_by_length``: one ``decode`` call per chunk length, each chunk's result in its place (the float64
    row sums recomputed alone), None for an empty chunk and for each chunk of a batch that raised one of ``skip``;
    any other exception goes to the caller."""
    from higgs_talker.codec.codec import decode_by_length

    chunks = [torch.arange(t * 2, dtype=torch.float64).reshape(1, 2, t) + i for i, t in enumerate((3, 5, 3, 0, 5, 3))]
    calls = []

    def decode(batch):
        calls.append(tuple(batch.shape))
        if (batch < 0).any():
            raise ValueError("negative")
        return batch.sum(dim=1)  # [B, T]: each row alone

    out = decode_by_length(decode, chunks, skip=(ValueError,))
    assert calls == [(3, 2, 3), (2, 2, 5)]
    for chunk, got in zip(chunks, out, strict=True):
        assert (got is None) if not chunk.numel() else torch.equal(got, chunk.sum(dim=1))
    chunks[2] = -chunks[2]
    out = decode_by_length(decode, chunks, skip=(ValueError,))
    assert [o is None for o in out] == [True, False, True, True, False, True]  # the length-3 batch raised
    with pytest.raises(ValueError, match="negative"):
        decode_by_length(decode, chunks)  # nothing skipped by default


def test_chunks_decoded_ahead_are_taken_in_order_and_none_once_the_loop_is_out_of_step():
    """``DecodedAhead``: each chunk's batched result goes to the loop's request for that very chunk (its shape and
    its place in the step's flat ids); asked for another, it answers None then and for the rest of the step."""
    from higgs_talker.codec.codec import DecodedAhead

    flat = torch.arange(24.0)
    a, b, c = flat[:6].reshape(1, 2, 3), flat[6:12].reshape(1, 2, 3), flat[12:24].reshape(1, 2, 6)
    ahead = DecodedAhead(lambda batch: batch.sum(dim=1), [a, b, c])
    assert torch.equal(ahead.take(a), a.sum(dim=1)) and torch.equal(ahead.take(b.view(1, 2, 3)), b.sum(dim=1))
    assert ahead.take(c) is not None and ahead.take(c) is None  # all taken
    ahead = DecodedAhead(lambda batch: batch.sum(dim=1), [a, b, c])
    assert ahead.take(b) is None  # a is next: out of step
    assert ahead.take(b) is None and ahead.take(c) is None  # the rest dropped


@pytest.mark.parametrize("rule", [AudioChunking(3, 1, 2, 1), AudioChunking(25, 1, 10, 4, ramp=False),
                                  AudioChunking(5, 5, 0, 0), AudioChunking(7, 2, 25, 3, 0)])  # fmt: skip
def test_delayed_rows_chunks_keep_what_the_codec_reads_of_the_whole_stream(rule):
    """``delayed_rows_chunk`` over rows handed on one a step (codes in and out of the codebook): the frames each
    chunk keeps (its window's emitted part) concatenate to ``codec_frames`` of all the rows, for every stream
    length; each window starts at most the rule's left context before its kept frames. Upstream's quirk kept: a
    finished stream's last frame is dropped from its last window only where that window holds two frames or more
    (without left context, a last chunk of one frame keeps it)."""
    gen = torch.Generator().manual_seed(rule.chunk_frames)
    for n in range(0, 60):
        rows = torch.randint(-2, 1027, (n, 8), generator=gen)
        kept, emitted = [], 0
        for i in range(n + 1):  # one call a row, and a last one with the finish
            chunk = delayed_rows_chunk(rows[:i].tolist(), emitted, i == n, rule)
            if chunk is None:
                continue
            window, frames = chunk
            assert window.emit_start == emitted and emitted - window.start <= rule.left_context_frames
            kept.append(frames[window.emit_start - window.start : window.emit_end - window.start])
            emitted, last_window = window.emit_end, window.end - window.start
        want = codec_frames(rows, 1024) if not kept or last_window > 1 else aligned_codes(rows, 1024)
        assert torch.equal(torch.cat(kept) if kept else torch.zeros(0, 8, dtype=torch.long), want), n

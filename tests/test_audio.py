"""Audio out of the API and CLI: WAV files, results carrying audio, streamed audio, references given as audio.

WAV files are checked against bytes built here with ``struct`` (reading) and against the stdlib ``wave``
reader (writing); audio against the codec decoding the same codes; reference audio against the codec
encoding the same samples.
"""

from __future__ import annotations

import json
import os
import re
import struct
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from _tolerance import rel_err
from safetensors.torch import load_file, save_file
from test_codec import decode_tolerance

from higgs_talker.api import HiggsTalker, Reference
from higgs_talker.audio import CodecLoader, ReferenceCache, read_wav, write_wav
from higgs_talker.checkpoint import CODEC_PREFIX
from higgs_talker.cli import main
from higgs_talker.codec import CODEC_CONFIG_FILE, TINY_CODEC, AudioChunking, Codec, build_config, config_to_dict
from higgs_talker.codec import random_tensors as random_codec_tensors
from higgs_talker.heads.sampling import SamplingParams

SMALL = dict(max_num_seqs=4, max_model_len=512)
PARAMS = SamplingParams(seed=11, temperature=0.9, max_frames=40)


@pytest.fixture(scope="module")
def talker(tiny_dir: Path) -> HiggsTalker:
    return HiggsTalker.from_pretrained(tiny_dir, **SMALL)


@pytest.fixture(scope="module")
def full_codec(tiny_dir: Path) -> Codec:
    return Codec.from_pretrained(tiny_dir, encoder=True)


@pytest.fixture(scope="module")
def codec_tensors(tiny_dir: Path) -> dict[str, torch.Tensor]:
    raw = load_file(str(tiny_dir / "model.safetensors"))
    return {k[len(CODEC_PREFIX) :]: v for k, v in raw.items() if k.startswith(CODEC_PREFIX)}


def noise(seconds: float, rate: int = 24000, seed: int = 0) -> np.ndarray:
    return (0.2 * np.random.default_rng(seed).standard_normal(int(seconds * rate))).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------
# WAV files


def wav_bytes(tag: int, channels: int, rate: int, bits: int, payload: bytes, extensible: bool = False) -> bytes:
    """A RIFF/WAVE file built field by field (the reader's independent reference)."""
    align = channels * bits // 8
    if extensible:
        fmt = struct.pack("<HHIIHHHHI", 0xFFFE, channels, rate, rate * align, align, bits, 22, bits, 0)
        fmt += struct.pack("<H", tag) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    else:
        fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    chunks += b"LIST" + struct.pack("<I", 3) + b"abc\x00"  # an odd-sized chunk the reader must skip (padded)
    chunks += b"data" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def with_block_align(wav: bytes, align: int) -> bytes:
    """``wav`` (as ``wav_bytes`` lays it out: fmt chunk first) with its header's block_align field replaced."""
    return wav[:32] + struct.pack("<H", align) + wav[34:]


@pytest.mark.parametrize(
    ("tag", "bits", "pack", "values", "expected"),
    [
        (1, 8, lambda v: bytes(v), [0, 128, 255, 64], [-1.0, 0.0, 127 / 128, -0.5]),
        (1, 16, lambda v: struct.pack("<4h", *v), [-32768, 0, 32767, 16384], [-1.0, 0.0, 32767 / 32768, 0.5]),
        (
            1,
            24,
            lambda v: b"".join(x.to_bytes(3, "little", signed=True) for x in v),
            [-(2**23), 0, 2**22, -1],
            [-1.0, 0.0, 0.5, -(2.0**-23)],
        ),  # fmt: skip
        (1, 32, lambda v: struct.pack("<4i", *v), [-(2**31), 0, 2**30, 2**31 - 1], [-1.0, 0.0, 0.5, 1 - 2.0**-31]),
        (3, 32, lambda v: struct.pack("<4f", *v), [0.25, -0.75, 1.5, 0.0], [0.25, -0.75, 1.5, 0.0]),
        (3, 64, lambda v: struct.pack("<4d", *v), [0.125, -2.0, 0.5, 1e-3], [0.125, -2.0, 0.5, 1e-3]),
    ],
)
@pytest.mark.parametrize("extensible", [False, True])
def test_read_wav_encodings(tmp_path: Path, tag, bits, pack, values, expected, extensible) -> None:
    path = tmp_path / "x.wav"
    path.write_bytes(wav_bytes(tag, 2, 22050, bits, pack(values), extensible))  # 2 channels x 2 frames
    samples, rate = read_wav(path)
    assert rate == 22050 and samples.dtype == np.float32 and samples.shape == (2, 2)
    np.testing.assert_allclose(samples.T.reshape(-1), np.float32(expected), rtol=0, atol=0)


def test_write_wav_is_16_bit_mono_and_clipped(tmp_path: Path) -> None:
    audio = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 3.0, -7.0, 1 / 65534])
    path = write_wav(tmp_path / "x.wav", audio, 24000)
    with wave.open(str(path)) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()) == (1, 2, 24000, 8)
        pcm = np.frombuffer(f.readframes(8), "<i2")
    assert pcm.tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767, 0]  # round half to even at 0.5 LSB
    back, rate = read_wav(path)
    assert rate == 24000 and np.abs(back[0] - np.clip(audio.numpy(), -1, 1)).max() <= 1 / 32767


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"not audio at all", "not a WAV file"),
        (b"RIFF\x04\x00\x00\x00WAVE", "no fmt"),
        (wav_bytes(2, 1, 8000, 4, b"\x00\x00"), "format tag 0x0002"),
        (wav_bytes(1, 1, 8000, 16, b"")[:-8], "no data"),
        (with_block_align(wav_bytes(1, 1, 8000, 16, b"\x00\x01" * 4), 4), "inconsistent WAV header.*align 4"),
    ],
)
def test_read_wav_refuses_what_it_cannot_read(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "bad.wav"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as info:
        read_wav(path)
    assert "bad.wav" in str(info.value)


def test_read_wav_names_a_directory_as_one(tmp_path: Path) -> None:
    """A directory given as the recording (Reference(audio=some_dir)) was reported as a file that 'does not
    exist'."""
    (tmp_path / "voice.wav").mkdir()
    with pytest.raises(IsADirectoryError, match=re.escape(f"{str(tmp_path / 'voice.wav')!r} is a directory")):
        read_wav(tmp_path / "voice.wav")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_wav(tmp_path / "missing.wav")


# ---------------------------------------------------------------------------------------------------------
# results carry audio


def test_results_carry_audio_decoded_on_first_access(tiny_dir: Path, codec_tensors) -> None:
    t = HiggsTalker.from_pretrained(tiny_dir, **SMALL)
    r = t.generate("Hello there.", PARAMS)
    assert t.codec_loader._decoder is None  # generating codes alone never loaded the codec
    assert r.sample_rate == 24000 and r._audio is None
    audio = r.audio
    assert audio.dtype == torch.float32 and audio.shape == (r.num_frames * 960,)
    assert torch.equal(audio, Codec.from_pretrained(tiny_dir).decode(r.codes))
    assert r.audio is audio  # decoded once


def test_save_wav(talker: HiggsTalker, tmp_path: Path) -> None:
    r = talker.generate("Hello there.", PARAMS)
    path = r.save(tmp_path / "hello.wav")
    with wave.open(str(path)) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 24000)
        pcm = np.frombuffer(f.readframes(f.getnframes()), "<i2")
    assert pcm.tolist() == np.round(np.clip(r.audio.numpy(), -1, 1) * 32767).astype(np.int16).tolist()
    with pytest.raises(ValueError, match=r"'\.mp3'"):
        r.save(tmp_path / "hello.mp3")
    assert r.save(tmp_path / "HELLO.WAV").read_bytes() == path.read_bytes()  # the suffix in any case


@pytest.mark.parametrize("name", ["codes.NPY", "codes.Npy", "codes.SafeTensors"])
def test_save_codes_with_an_upper_case_suffix(talker: HiggsTalker, tmp_path: Path, name: str) -> None:
    """The suffix counts in any case: np.save appends '.npy' to a name not ending in '.npy' exactly, which wrote
    the codes beside the temporary file and renamed an empty file to codes.NPY (the CLI said 'wrote')."""
    r = talker.generate("Hello there.", PARAMS)
    path = r.save(tmp_path / name)
    assert [p.name for p in tmp_path.iterdir()] == [name]  # nothing left beside it
    if name.lower().endswith(".npy"):
        assert np.array_equal(np.load(path), r.codes.numpy())
    else:
        saved = load_file(str(path))
        assert torch.equal(saved["codes"], r.codes) and torch.equal(saved["rows"], r.rows)


def test_save_replaces_the_file_whole_or_not_at_all(talker: HiggsTalker, tmp_path: Path, monkeypatch) -> None:
    """save writes a temporary file beside the target and renames it: a write that fails (or a Ctrl-C) leaves
    the old file as it was and no temporary file behind; a new file gets the umask's permissions."""
    r = talker.generate("Hello there.", PARAMS)
    path = tmp_path / "codes.npy"
    path.write_bytes(b"old")

    def broken(file, array):
        Path(file).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "save", broken)
    with pytest.raises(KeyboardInterrupt):
        r.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["codes.npy"] and path.read_bytes() == b"old"
    monkeypatch.undo()
    r.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["codes.npy"] and np.array_equal(np.load(path), r.codes.numpy())
    umask = os.umask(0o022)
    os.umask(umask)
    assert (r.save(tmp_path / "new.wav").stat().st_mode & 0o777) == 0o666 & ~umask
    with pytest.raises(FileNotFoundError, match=re.escape(f"'{tmp_path / 'nodir' / 'x.wav'}'")):
        r.save(tmp_path / "nodir" / "x.wav")  # the path asked for, not the temporary file's
    link = tmp_path / "link.npy"
    link.symlink_to(path)
    r.save(link)  # written through the link, which stays a link
    assert link.is_symlink() and np.array_equal(np.load(path), r.codes.numpy())


@pytest.mark.parametrize("name", ["new.wav", "new.npy", "new.safetensors"])
def test_save_gives_a_new_file_the_umask_permissions(talker: HiggsTalker, tmp_path: Path, name: str) -> None:
    """safetensors' save_file writes its own temporary file (mode 0600) and renames it: a .safetensors result was
    readable by its owner only, where .wav and .npy follow the umask."""
    r = talker.generate("Hello there.", PARAMS)
    umask = os.umask(0o022)
    os.umask(umask)
    assert (r.save(tmp_path / name).stat().st_mode & 0o777) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_talker_without_codec(tiny_dir: Path, tmp_path: Path) -> None:
    t = HiggsTalker.from_pretrained(tiny_dir, codec=False, **SMALL)
    r = t.generate("Hello there.", PARAMS)
    assert r.audio is None and r.sample_rate is None
    with pytest.raises(ValueError, match="no audio"):
        r.save(tmp_path / "x.wav")
    with pytest.raises(ValueError, match="no codec"):
        _ = t.codec
    with pytest.raises(ValueError, match="needs a codec"):
        t.build_prompt("Hi.", Reference(audio=noise(1.5), sample_rate=24000))


def test_bad_codec_dtype_is_refused_at_load(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="float16"):
        HiggsTalker.from_pretrained(tiny_dir, codec_dtype="float16", **SMALL)


def test_stream_audio_equals_generate(talker: HiggsTalker, codec_tensors) -> None:
    params = SamplingParams(seed=5, temperature=0.9, max_frames=60, min_frames=60)
    whole = talker.generate("Streaming.", params).audio
    chunks = list(talker.stream_audio("Streaming.", params))
    frames = [c.shape[0] // 960 for c in chunks]
    assert frames[:6] == [1, 1, 2, 4, 8, 16] and set(frames[6:-1]) <= {25}  # the ramp: each as long as those before
    assert sum(frames) * 960 == whole.shape[0]
    assert rel_err(torch.cat(chunks), whole) <= 2 * decode_tolerance(codec_tensors, torch.float32)
    coarse = talker.stream_audio("Streaming.", params, chunking=AudioChunking(chunk_frames=40, first_chunk_frames=40))
    assert [c.shape[0] // 960 for c in coarse] == [40, sum(frames) - 40]


# ---------------------------------------------------------------------------------------------------------
# references given as audio


def test_reference_audio_is_encoded_and_cached(talker: HiggsTalker, full_codec: Codec, tmp_path: Path) -> None:
    samples = noise(1.6, 16000, seed=3)
    path = write_wav(tmp_path / "ref.wav", samples, 16000)
    with wave.open(str(path)) as f:  # what the file holds, read independently
        pcm = np.frombuffer(f.readframes(f.getnframes()), "<i2").astype(np.float32) / 32768
    codes = full_codec.encode(pcm, 16000)
    assert codes.shape == (40, 8)
    want = talker.build_prompt("Say it.", Reference(codes=codes, text="reference words"))
    cache = talker.codec_loader.cache
    before = (cache.hits, cache.misses)
    for _ in range(2):
        got = talker.build_prompt("Say it.", Reference(audio=path, text="reference words"))
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert torch.equal(got.audio_codes, want.audio_codes)
    assert (cache.hits - before[0], cache.misses - before[1]) == (1, 1)
    from_samples = talker.build_prompt("Say it.", Reference(audio=torch.from_numpy(pcm), sample_rate=16000))
    assert torch.equal(from_samples.audio_codes, want.audio_codes)
    result = talker.generate("Say it.", PARAMS, reference=Reference(audio=str(path), text="reference words"))
    assert result.num_frames > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(), "exactly one"),
        (dict(codes=np.zeros((3, 8), np.int64), audio="x.wav"), "exactly one"),
        (dict(audio=np.zeros(24000, np.float32)), "sample_rate"),
        (dict(audio="x.wav", sample_rate=16000), "WAV file gives its own rate"),
    ],
)
def test_bad_reference_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Reference(**kwargs)


@pytest.mark.parametrize(
    ("seconds", "match"), [(0.5, "lasts 0.50 s; reference audio must last 1-30 s"), (31, "lasts 31.00 s")]
)
def test_reference_audio_length_is_checked(talker: HiggsTalker, seconds: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        talker.build_prompt("Hi.", Reference(audio=noise(seconds), sample_rate=24000))


@pytest.mark.parametrize("seconds", [1.0, 30.0])
def test_reference_audio_at_the_length_limits_is_taken(talker: HiggsTalker, seconds: float) -> None:
    prompt = talker.build_prompt("Hi.", Reference(audio=noise(seconds), sample_rate=24000))
    assert prompt.audio_codes is not None and prompt.audio_codes.shape[0] > 0


def test_reference_that_is_not_audio(talker: HiggsTalker, tmp_path: Path) -> None:
    (tmp_path / "notes.wav").write_text("these are my notes")
    with pytest.raises(ValueError, match="notes.wav is not a WAV file"):
        talker.build_prompt("Hi.", Reference(audio=tmp_path / "notes.wav"))
    with pytest.raises(FileNotFoundError, match="missing.wav"):
        talker.build_prompt("Hi.", Reference(audio=tmp_path / "missing.wav"))


def write_tokenizer_dir(path: Path, seed: int, config: dict | None = None) -> Path:
    """An audio tokenizer directory in transformers' layout with its own random weights."""
    path.mkdir(parents=True)
    cfg = build_config(config or TINY_CODEC)
    tensors = random_codec_tensors(cfg, seed=seed)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    return path


def test_audio_tokenizer_directory_encodes_references(tiny_dir: Path, tmp_path: Path, full_codec: Codec) -> None:
    tokenizer = write_tokenizer_dir(tmp_path / "tok", seed=7)
    t = HiggsTalker.from_pretrained(tiny_dir, audio_tokenizer=tokenizer, **SMALL)
    samples = noise(1.2, seed=4)
    got = t.build_prompt("Hi.", Reference(audio=samples, sample_rate=24000)).audio_codes
    theirs = Codec.from_pretrained(tokenizer, encoder=True).encode(samples, 24000)
    want = t.build_prompt("Hi.", Reference(codes=theirs)).audio_codes
    assert torch.equal(got, want)
    assert not torch.equal(theirs, full_codec.encode(samples, 24000))  # not the bundled encoder
    codes = torch.randint(0, 1024, (5, 8))
    assert torch.equal(t.codec.decode(codes), full_codec.decode(codes))  # decoding stays with the bundled codec


def test_codec_that_does_not_fit_the_talker(tiny_dir: Path, tmp_path: Path) -> None:
    """A 16-quantizer codec (transformers 5.14+'s default bandwidths) beside an 8-codebook talker: refused by the
    load, from the codec's config; a loader made without that check refuses it when the codec loads."""
    wide = dict(TINY_CODEC, target_bandwidths=[0.5, 1, 1.5, 2, 4])
    path = tmp_path / "ckpt"
    path.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (path / f).write_bytes((tiny_dir / f).read_bytes())
    talker_tensors = {k: v for k, v in load_file(str(tiny_dir / "model.safetensors")).items()
                      if not k.startswith(CODEC_PREFIX)}  # fmt: skip
    codec = {CODEC_PREFIX + k: v for k, v in random_codec_tensors(build_config(wide)).items()}
    save_file(talker_tensors | codec, str(path / "model.safetensors"))
    (path / CODEC_CONFIG_FILE).write_text(json.dumps(config_to_dict(build_config(wide))))
    misfit = r"does not fit the talker: codes per frame 16 \(talker: 8\)"
    with pytest.raises(ValueError, match=misfit):
        HiggsTalker.from_pretrained(path, **SMALL)
    t = HiggsTalker.from_pretrained(path, codec=False, **SMALL)
    loader = CodecLoader(path, torch.device("cpu"), talker=t.cfg)
    with pytest.raises(ValueError, match=misfit):
        loader.decoder()


def test_reference_cache_is_lru() -> None:
    cache = ReferenceCache(size=2)
    keys = [ReferenceCache.key(torch.full((10,), float(i)), 24000) for i in range(3)]
    assert len(set(keys)) == 3 and ReferenceCache.key(torch.zeros(10), 16000) != keys[0]
    for i, k in enumerate(keys[:2]):
        cache.put(k, torch.full((1, 8), i))
    assert cache.get(keys[0]) is not None  # 0 is now the most recent
    cache.put(keys[2], torch.full((1, 8), 2))
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None and len(cache) == 2
    stored = torch.full((1, 8), 5)
    cache.put(keys[1], stored)
    stored.fill_(6)  # the caller's tensors are its own: neither what it put nor what it got edits the cache
    cache.get(keys[1]).fill_(7)
    assert torch.equal(cache.get(keys[1]), torch.full((1, 8), 5))


# ---------------------------------------------------------------------------------------------------------
# CLI


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_writes_wav_and_clones_from_wav(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    base = ["generate", "Hello there.", "--model", str(tiny_dir), "--seed", "3", "--max-frames", "40", "--no-progress"]
    rc, out, _ = run_cli([*base, "--out", str(tmp_path / "a.wav")], capsys)
    assert rc == 0 and "wrote" in out
    with wave.open(str(tmp_path / "a.wav")) as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, 24000) and f.getnframes() > 0
    write_wav(tmp_path / "ref.wav", noise(1.5), 24000)
    args = [
        *base,
        "--reference",
        str(tmp_path / "ref.wav"),
        "--reference-text",
        "noise",
        "--out",
        str(tmp_path / "b.npy"),
    ]
    rc, _, _ = run_cli(args, capsys)
    assert rc == 0 and np.load(tmp_path / "b.npy").shape[1] == 8


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--out", "x.mp3"], "unsupported format '.mp3'"),
        (["--reference", "{tmp}/notes.wav"], "notes.wav is not a WAV file"),
        (["--reference", "{tmp}/short.wav"], "lasts 0.20 s"),
    ],
)
def test_cli_mistakes_exit_with_one_line(tiny_dir: Path, tmp_path: Path, capsys, extra, match) -> None:
    (tmp_path / "notes.wav").write_text("notes")
    write_wav(tmp_path / "short.wav", noise(0.2), 24000)
    args = ["generate", "Hi.", "--model", str(tiny_dir), "--no-progress", *[e.format(tmp=tmp_path) for e in extra]]
    rc, out, err = run_cli(args, capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("higgs-talker: error:") and match in err
    assert "Traceback" not in err and not (tmp_path / "x.mp3").exists()


def test_cli_demo_writes_wavs(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    args = ["demo", "--model", str(tiny_dir), "--out", str(tmp_path / "codes.npy"), "--wav-dir", str(tmp_path / "w")]
    rc, out, _ = run_cli(args, capsys)
    assert rc == 0
    wavs = sorted((tmp_path / "w").glob("higgs_demo_*.wav"))
    assert [p.name for p in wavs] == ["higgs_demo_0.wav", "higgs_demo_1.wav", "higgs_demo_2.wav"]
    for p in wavs:
        with wave.open(str(p)) as f:
            assert f.getframerate() == 24000 and f.getnframes() % 960 == 0

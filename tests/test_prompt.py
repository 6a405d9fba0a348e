"""Prompt layouts and their validation (SPEC 1.3, 3.1-3.2)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from higgs_talker.prompt import Prompt, TalkerTokenizer, check_reference_codes
from higgs_talker.tiny import tiny_config

BOC, EOC, N = 1024, 1025, 8
CFG = tiny_config()


@pytest.fixture(scope="module")
def tok(tiny_dir) -> TalkerTokenizer:
    return TalkerTokenizer.from_pretrained(tiny_dir, CFG)


def ref_codes(frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1024, (frames, N), generator=torch.Generator().manual_seed(seed))


def delayed(codes: torch.Tensor) -> list[list[int]]:
    """SPEC 3.2 by hand: column c is BOC x c, the T codes, then EOC x (7 - c)."""
    t = codes.shape[0]
    cols = [[BOC] * c + codes[:, c].tolist() + [EOC] * (N - 1 - c) for c in range(N)]
    return [[cols[c][r] for c in range(N)] for r in range(t + N - 1)]


def test_special_ids_resolved_from_added_vocab(tok):
    added = tok.tokenizer.get_added_vocab()
    sp = tok.specials
    assert (sp.tts, sp.text, sp.audio) == (added["<|tts|>"], added["<|text|>"], added["<|audio|>"])
    assert (sp.ref_audio, sp.ref_text) == (added["<|ref_audio|>"], added["<|ref_text|>"])
    assert sp.eos == tok.tokenizer.eos_token_id == added["<|endoftext|>"]
    assert len({sp.tts, sp.text, sp.audio, sp.eos, sp.ref_audio, sp.ref_text}) == 6


@pytest.mark.parametrize("text", ["Hello world", "a", "Grüße, 世界!", "  padded  "])
def test_plain_layout(tok, text):
    sp = tok.specials
    prompt = tok.build(text)
    ids = prompt.input_ids.tolist()
    assert prompt.input_ids.dtype == torch.long
    assert ids[:2] == [sp.tts, sp.text] and ids[-1] == sp.audio
    body = ids[2:-1]
    assert body == tok.tokenizer.encode(text, add_special_tokens=False)
    assert len(body) == len(text.encode("utf-8"))  # byte-level, no merges: one token per byte
    assert tok.tokenizer.decode(body) == text
    assert prompt.audio_codes is None and prompt.audio_positions is None
    assert len(prompt) == len(ids)
    assert sp.ref_audio not in ids and sp.ref_text not in ids


@pytest.mark.parametrize("frames", [1, 4])
def test_voice_clone_layout_without_ref_text(tok, frames):
    sp = tok.specials
    codes = ref_codes(frames)
    prompt = tok.build("Hi there", codes, cfg=CFG)
    ids = prompt.input_ids.tolist()
    rows = frames + 7
    enc = tok.encode("Hi there")
    assert ids == [sp.tts, sp.ref_audio] + [sp.tts] * rows + [sp.text, *enc, sp.audio]
    assert prompt.audio_positions.tolist() == list(range(2, 2 + rows))
    assert prompt.audio_positions.dtype == torch.long
    assert prompt.audio_codes.tolist() == delayed(codes)
    assert prompt.audio_codes.shape == (rows, N)
    assert all(ids[p] == sp.tts for p in prompt.audio_positions.tolist())  # placeholders are the tts id
    assert min(ids) >= 0 and max(ids) < CFG.text.vocab_size  # no -100 sentinel left


def test_voice_clone_layout_with_ref_text(tok):
    sp = tok.specials
    codes = ref_codes(3, seed=1)
    prompt = tok.build("Say this.", codes, reference_text="Ref words", cfg=CFG)
    ids = prompt.input_ids.tolist()
    ref_enc, enc = tok.encode("Ref words"), tok.encode("Say this.")
    start = 2 + len(ref_enc) + 1
    assert ids == [sp.tts, sp.ref_text, *ref_enc, sp.ref_audio] + [sp.tts] * 10 + [sp.text, *enc, sp.audio]
    assert prompt.audio_positions.tolist() == list(range(start, start + 10))
    assert prompt.audio_codes.tolist() == delayed(codes)


def test_vllm_prompt_salts_a_clone_by_its_reference_rows(tok):
    """vLLM's prefix cache hashes token ids and ``cache_salt`` only, and two voices of one length give the same ids:
    the salt names the rows and their positions (not the text), and a plain prompt has none."""
    codes = ref_codes(4, seed=1)
    changed = codes.clone()
    changed[2, 5] = (changed[2, 5] + 1) % 1024
    a = tok.build("Same words.", codes, cfg=CFG)
    b = tok.build("Same words.", changed, cfg=CFG)
    assert torch.equal(a.input_ids, b.input_ids)  # the ids alone cannot tell the voices apart
    salt = a.vllm_prompt()["cache_salt"]
    assert a.vllm_prompt() == {"prompt_token_ids": a.input_ids.tolist(), "cache_salt": salt}
    assert re.fullmatch(r"[0-9a-f]{32}", salt)
    assert tok.build("Same words.", codes.clone(), cfg=CFG).vllm_prompt()["cache_salt"] == salt
    assert tok.build("Other words here.", codes, cfg=CFG).reference_digest() == salt  # same voice: blocks shared
    assert b.reference_digest() != salt  # one code changed
    assert tok.build("Same words.", codes, "Ref words", CFG).reference_digest() != salt  # the rows moved
    plain = tok.build("Same words.")
    assert plain.reference_digest() is None
    assert plain.vllm_prompt() == {"prompt_token_ids": plain.input_ids.tolist()}


def test_reference_digest_is_stable():
    """A fixed value (int64 little-endian bytes through blake2b, never Python's hash()), whatever the codes' dtype:
    another process, machine or release names the same rows the same way."""
    rows = [[1, 2], [3, 1025]]
    for dtype in (torch.int64, torch.int32):
        prompt = Prompt(torch.arange(6), torch.tensor(rows, dtype=dtype), torch.tensor([2, 3]))
        assert prompt.reference_digest() == "0e666ccbc5883131ab8bf07bac9e5a2f"
    assert Prompt(
        torch.arange(6), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    ).vllm_prompt() == {"prompt_token_ids": list(range(6))}  # no rows replace an embedding: the ids name the prompt


def test_reference_codes_accept_lists_numpy_and_int32(tok):
    codes = ref_codes(2, seed=2)
    want = tok.build("x", codes, cfg=CFG)
    alts = [codes.tolist(), codes.numpy(), codes.to(torch.int32), codes.numpy().astype(np.int16)]
    # codecs often store codes unsigned; torch lacks min/max for uint16/32/64, which must not matter here
    alts += [codes.numpy().astype(dt) for dt in (np.uint16, np.uint32, np.uint64)]
    alts += [codes.to(dt) for dt in (torch.uint16, torch.uint32)]
    for alt in alts:
        got = tok.build("x", alt, cfg=CFG)
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.audio_codes, want.audio_codes)
        assert got.audio_codes.dtype == torch.long


@pytest.mark.parametrize("text", ["", " ", "\n\t  "])
def test_empty_text_rejected(tok, text):
    with pytest.raises(ValueError, match="empty"):
        tok.build(text)
    with pytest.raises(ValueError, match="reference_text.*empty"):
        tok.build("fine", ref_codes(1), reference_text=text, cfg=CFG)


def test_non_string_text_rejected(tok):
    with pytest.raises(ValueError, match="string"):
        tok.build(123)  # type: ignore[arg-type]


@pytest.mark.parametrize("special", ["<|audio|>", "<|tts|>", "<|endoftext|>", "<|ref_audio|>"])
def test_text_with_special_token_rejected(tok, special):
    with pytest.raises(ValueError, match="special token"):
        tok.build(f"say {special} now")
    with pytest.raises(ValueError, match="reference_text.*special token"):
        tok.build("fine", ref_codes(1), reference_text=f"x{special}", cfg=CFG)


@pytest.mark.parametrize(
    "codes, match",
    [
        (torch.zeros(4, 7, dtype=torch.long), "shape"),
        (torch.zeros(4, 9, dtype=torch.long), "shape"),
        (torch.zeros(8, dtype=torch.long), "shape"),
        (torch.zeros(0, 8, dtype=torch.long), "shape"),
        (torch.zeros(2, 8, 1, dtype=torch.long), "shape"),
        (torch.full((2, 8), 1024), "1024"),
        (torch.full((2, 8), 1025), "1025"),
        (torch.tensor([[0] * 7 + [-1]]), "-1"),
        (torch.zeros(3, 8), "integers"),
        (torch.zeros(3, 8, dtype=torch.float16), "integers"),
        (torch.zeros(3, 8, dtype=torch.bool), "integers"),
        ([[1, 2], [3]], "integer array"),
        ("codes", "integer"),
    ],
    ids=[
        "7_codebooks",
        "9_codebooks",
        "1d",
        "no_frames",
        "3d",
        "boc",
        "eoc",
        "negative",
        "float32",
        "float16",
        "bool",
        "ragged",
        "string",
    ],
)
def test_bad_reference_codes(tok, codes, match):
    with pytest.raises(ValueError, match=match):
        tok.build("hello", codes, cfg=CFG)
    with pytest.raises(ValueError):
        check_reference_codes(codes, CFG)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64])
def test_unsigned_reference_codes_out_of_range(tok, dtype):
    codes = np.zeros((2, N), dtype=dtype)
    codes[1, 3] = 2000
    with pytest.raises(ValueError, match="2000"):
        tok.build("hello", codes, cfg=CFG)
    if dtype is np.uint64:
        codes[1, 3] = 2**64 - 1  # wraps to -1 in int64: still refused
        with pytest.raises(ValueError, match="outside the real code range"):
            tok.build("hello", codes, cfg=CFG)


def test_reference_text_without_codes_rejected(tok):
    with pytest.raises(ValueError, match="reference_text"):
        tok.build("hello", reference_text="ref")


def test_voice_clone_needs_config(tok):
    with pytest.raises(ValueError, match="TalkerConfig"):
        tok.build("hello", ref_codes(1))


def test_prompt_longer_than_context_rejected(tiny_dir):
    small = tiny_config(text={"max_position_embeddings": 32})
    tok = TalkerTokenizer.from_pretrained(tiny_dir, small)
    tok.build("x" * 20)  # 23 tokens fit
    assert len(tok.build("x" * 28).input_ids) == 31  # one short of the limit: fits
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tok.build("x" * 29)  # exactly 32 tokens: no room for a generated one
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tok.build("x" * 40)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tok.build("x", ref_codes(30), cfg=small)  # 37 placeholder rows alone overflow


def test_special_id_outside_vocab_rejected(tiny_dir):
    with pytest.raises(ValueError, match="outside the text vocabulary"):
        TalkerTokenizer.from_pretrained(tiny_dir, tiny_config(text={"vocab_size": 258}))


# --------------------------------------------------------------------------------------------- custom tokenizers


def write_tokenizer(directory, specials: list[str], eos: str | None) -> None:
    """A word-level tokenizer with the given added special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos is not None:
        config["eos_token"] = eos
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_tokenizer_missing_audio_token_rejected(tmp_path):
    write_tokenizer(tmp_path, ["<|eos|>", "<|tts|>", "<|text|>"], "<|eos|>")
    with pytest.raises(ValueError, match=r"<\|audio\|>"):
        TalkerTokenizer.from_pretrained(tmp_path, CFG)


def test_tokenizer_missing_several_required_tokens_lists_them(tmp_path):
    write_tokenizer(tmp_path, ["<|eos|>", "<|text|>"], "<|eos|>")
    with pytest.raises(ValueError, match=r"<\|tts\|>.*<\|audio\|>"):
        TalkerTokenizer.from_pretrained(tmp_path, CFG)


def test_tokenizer_without_optional_specials(tmp_path):
    write_tokenizer(tmp_path, ["<|eos|>", "<|tts|>", "<|text|>", "<|audio|>"], "<|eos|>")
    tok = TalkerTokenizer.from_pretrained(tmp_path, CFG)
    assert tok.specials.ref_audio is None and tok.specials.ref_text is None
    sp = tok.specials
    assert tok.build("hello world").input_ids.tolist() == [sp.tts, sp.text, 1, 2, sp.audio]
    with pytest.raises(ValueError, match="ref_audio"):
        tok.build("hello", ref_codes(1), cfg=CFG)


def test_tokenizer_without_ref_text_token(tmp_path):
    write_tokenizer(tmp_path, ["<|eos|>", "<|tts|>", "<|text|>", "<|audio|>", "<|ref_audio|>"], "<|eos|>")
    tok = TalkerTokenizer.from_pretrained(tmp_path, CFG)
    tok.build("hello", ref_codes(1), cfg=CFG)  # cloning without a transcript works
    with pytest.raises(ValueError, match="ref_text"):
        tok.build("hello", ref_codes(1), reference_text="world", cfg=CFG)


def test_the_tokenizers_eos_comes_before_the_configs(tmp_path):
    """The tokenizer's end token comes first; config.json's eos_token_id only stands in where it has none."""
    write_tokenizer(tmp_path, ["<|eos|>", "<|tts|>", "<|text|>", "<|audio|>"], "<|eos|>")
    tok = TalkerTokenizer.from_pretrained(tmp_path, CFG)  # CFG.eos_token_id == 256; the tokenizer's <|eos|> is 3
    assert tok.specials.eos == tok.tokenizer.convert_tokens_to_ids("<|eos|>") != CFG.eos_token_id


def test_eos_falls_back_to_config_then_errors(tmp_path):
    write_tokenizer(tmp_path, ["<|tts|>", "<|text|>", "<|audio|>"], None)
    tok = TalkerTokenizer.from_pretrained(tmp_path, CFG)  # CFG.eos_token_id == 256
    assert tok.specials.eos == CFG.eos_token_id
    no_eos = tiny_config(eos_token_id=None)
    with pytest.raises(ValueError, match="eos"):
        TalkerTokenizer.from_pretrained(tmp_path, no_eos)


def test_missing_tokenizer_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        TalkerTokenizer.from_pretrained(tmp_path, CFG)


def test_checkpoint_without_tokenizer_json_names_the_file(tiny_dir, tmp_path):
    """With tokenizer_config.json but no tokenizer.json, transformers asked for sentencepiece or tiktoken."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=re.escape(f"{str(ckpt)!r}: it has no tokenizer.json")) as info:
        TalkerTokenizer.from_pretrained(ckpt, CFG)
    assert "sentencepiece" not in str(info.value)


def _auto_tokenizer(path):
    """The reference: transformers' AutoTokenizer with our config class registered (what the loader did before)."""
    from transformers import AutoTokenizer

    from higgs_talker.config import register_hf_config

    register_hf_config()
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


@pytest.mark.parametrize(
    ("tokenizer_class", "in_config_json"),
    [
        ("PreTrainedTokenizerFast", False),  # the tiny checkpoint's own
        ("TokenizersBackend", False),
        ("Qwen2Tokenizer", False),  # the Qwen3 family's
        ("Qwen2TokenizerFast", False),
        ("Qwen2Tokenizer", True),  # named only in config.json: AutoTokenizer reads it there
    ],
)
def test_tokenizer_is_the_one_autotokenizer_picks(tiny_dir, tmp_path, tokenizer_class, in_config_json):
    """The loader names the tokenizer class itself where tokenizer_config.json makes the choice plain (importing
    AutoTokenizer costs seconds of a warm start on the GPU image); the class, the ids and the specials are
    AutoTokenizer's for each way a checkpoint may name it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg = json.loads((ckpt / "config.json").read_text())
    del tok_cfg["tokenizer_class"]
    (tok_cfg if not in_config_json else cfg)["tokenizer_class"] = tokenizer_class
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (ckpt / "config.json").write_text(json.dumps(cfg))
    ours = TalkerTokenizer.from_pretrained(ckpt, CFG)
    reference = _auto_tokenizer(ckpt)
    assert type(ours.tokenizer) is type(reference)
    for text in ("Hello world, it's 12:30 - déjà vu.", "  two  spaces\tand a tab", "<|tts|> in text", "数字 42"):
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
    assert ours.tokenizer.get_added_vocab() == reference.get_added_vocab()
    assert ours.specials.eos == reference.eos_token_id


def test_loading_never_imports_transformers_model_registry(tiny_dir):
    """Importing AutoTokenizer or our transformers config class (it holds a Qwen3Config) imports transformers'
    model-class registry, which on transformers 5.17 (the H100/H200 image) brings its generation and modeling code,
    torch._dynamo and sympy: 9.3 s of a profiled warm start there (h100_20261205). The direct engine's load needs
    none."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from higgs_talker import HiggsTalker\n"
        f"HiggsTalker.from_pretrained({str(tiny_dir)!r}, codec=False)\n"
        "print([m for m in ('transformers.models.auto.modeling_auto', 'transformers.models.auto.tokenization_auto', "
        "'transformers.models.qwen3', 'transformers.modeling_utils') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]"], out

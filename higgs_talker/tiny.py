"""The embedded default checkpoint: a tiny, deterministic ``higgs_multimodal_qwen3`` checkpoint.

It has the real layout (config.json, safetensors with the real key names, tokenizer.json with the special
tokens) and is loaded through the same code as a real checkpoint. It is built from a fixed seed, written once
into a cache directory, and rebuilt when the recipe changes.

It bundles a tiny codec under the real codec prefix, stored in BF16 as the real checkpoint's is: the full
``HiggsAudioV2TokenizerModel`` key layout of ``codec.TINY_CODEC`` (the real strides, hop 960 and 8 x 1024
codebooks with small channels), with its config in ``codec_config.json`` because the real checkpoint's codec
config is not in any file (``codec.HIGGS_V3_CODEC``). Its weights come from their own generator, so the
talker's tensors are bit-identical to recipe 1's.

Its weights are random with one designed feature: hidden dimension 0 is a constant "bias channel" (every
embedding row has a constant there and no layer writes to it), and codebook 0's EOC row carries extra weight
on it, so sampled generations end naturally after a few seconds of audio instead of running to the cap.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from .checkpoint import CODEC_PREFIX, TEXT_HEAD_KEY, save_checkpoint
from .config import TalkerConfig, TextConfig

TINY_NAME = "tiny"
RECIPE_VERSION = 2  # 2: a real-layout tiny codec replaces two placeholder codec tensors
SPECIAL_TOKENS = ("<|endoftext|>", "<|tts|>", "<|text|>", "<|audio|>", "<|ref_audio|>", "<|ref_text|>", "<|audio_end|>")


def tiny_config(**overrides) -> TalkerConfig:
    """The tiny model's config: 3 layers, hidden 64, 4 query / 2 KV heads of dim 32 (GQA, q_size != hidden)."""
    text = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    text.update(overrides.pop("text", {}))
    overrides.setdefault("eos_token_id", 256)
    return TalkerConfig(text=TextConfig(**text), **overrides)


def tiny_weights(
    cfg: TalkerConfig, seed: int = 0, eoc_bias: float = 2.5, table_std: float = 0.25, codec: bool = True
) -> dict[str, torch.Tensor]:
    """Deterministic checkpoint-named tensors for ``cfg`` (any shape, not only the tiny one).

    The talker's are fp32; ``codec`` adds the tiny codec's (``tiny_codec_weights``, BF16).
    """
    g = torch.Generator().manual_seed(seed)
    t = cfg.text
    h, d = t.hidden_size, t.head_dim

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm_weight(n: int) -> torch.Tensor:
        return 1.0 + randn(n, std=0.1)

    table = randn(cfg.num_codebooks * cfg.codebook_size, h, std=table_std)
    table[:, 0] = 0.25  # bias channel: the 8-row sum is constant 2.0 in dim 0
    table[cfg.eoc_id, 0] += eoc_bias  # codebook 0's EOC row (rows 0 .. V-1 are codebook 0)
    embed = randn(t.vocab_size, h, std=1.0)
    embed[:, 0] = 0.5
    w: dict[str, torch.Tensor] = {
        "tied.embedding.text_embedding.weight": embed,
        "body.norm.weight": norm_weight(h),
        "tied.embedding.modality_embeddings.0.embedding.weight": table,
    }
    randn(16 * 8 + 4 * 4 * 3, std=1.0)  # recipe 1's placeholder codec tensors: drawn still, so the layers match
    if codec:  # codec weights ride along in real checkpoints (where recipe 1 had them); the talker skips them
        w |= tiny_codec_weights(seed, cfg)
    for i in range(t.num_hidden_layers):
        p = f"body.layers.{i}."
        o_proj = randn(h, t.q_size, std=0.5 / t.q_size**0.5)
        down = randn(h, t.intermediate_size, std=0.5 / t.intermediate_size**0.5)
        o_proj[0] = 0.0  # nothing writes the bias channel
        down[0] = 0.0
        w |= {
            p + "input_layernorm.weight": norm_weight(h),
            p + "post_attention_layernorm.weight": norm_weight(h),
            p + "self_attn.q_proj.weight": randn(t.q_size, h, std=h**-0.5),
            p + "self_attn.k_proj.weight": randn(t.kv_size, h, std=h**-0.5),
            p + "self_attn.v_proj.weight": randn(t.kv_size, h, std=h**-0.5),
            p + "self_attn.o_proj.weight": o_proj,
            p + "self_attn.q_norm.weight": norm_weight(d),
            p + "self_attn.k_norm.weight": norm_weight(d),
            p + "mlp.gate_proj.weight": randn(t.intermediate_size, h, std=h**-0.5),
            p + "mlp.up_proj.weight": randn(t.intermediate_size, h, std=h**-0.5),
            p + "mlp.down_proj.weight": down,
        }
        if t.attention_bias:
            w |= {
                p + "self_attn.q_proj.bias": randn(t.q_size, std=0.1),
                p + "self_attn.k_proj.bias": randn(t.kv_size, std=0.1),
                p + "self_attn.v_proj.bias": randn(t.kv_size, std=0.1),
            }
    if not t.tie_word_embeddings:
        w[TEXT_HEAD_KEY] = randn(t.vocab_size, h, std=1.0)
    if not cfg.tie_modality_embeddings:
        w["tied.head.modality_heads.0.weight"] = table + randn(*table.shape, std=0.1)
    return w


def tiny_codec(cfg: TalkerConfig | None = None) -> dict:
    """The tiny codec's config for ``cfg``'s codes (None: the tiny talker's): ``codec.TINY_CODEC``, whose 8
    quantizers of 1024 codes fit 8 codebooks of 1024 real codes, or the same codec with one quantizer per codebook of
    ``cfg.num_real_codes`` codes."""
    from .codec import TINY_CODEC

    if cfg is None or (cfg.num_codebooks, cfg.num_real_codes) == (8, TINY_CODEC["codebook_size"]):
        return TINY_CODEC
    bits = math.ceil(math.log2(cfg.num_real_codes))
    rate = TINY_CODEC["sample_rate"] // TINY_CODEC["acoustic_model_config"]["hop_length"]
    # transformers counts 1000 * bandwidth // (rate * bits) quantizers: half a bit a second keeps rounding off it
    bandwidth = (cfg.num_codebooks * rate * bits + 0.5) / 1000
    return dict(TINY_CODEC, codebook_size=cfg.num_real_codes, target_bandwidths=[bandwidth])


def tiny_codec_weights(seed: int = 0, cfg: TalkerConfig | None = None) -> dict[str, torch.Tensor]:
    """The tiny codec's tensors (``tiny_codec(cfg)``) under the codec prefix, BF16, from their own generator."""
    return dict(_tiny_codec_weights(seed, json.dumps(tiny_codec(cfg), sort_keys=True)))


@lru_cache(maxsize=4)
def _tiny_codec_weights(seed: int, codec: str) -> dict[str, torch.Tensor]:
    from .codec import build_config, random_tensors

    tensors = random_tensors(build_config(json.loads(codec)), seed=seed)
    return {CODEC_PREFIX + k: v.to(torch.bfloat16) for k, v in tensors.items()}


def write_codec_config(directory: Path, cfg: TalkerConfig | None = None) -> None:
    """``codec_config.json``: the tiny codec's config (the real checkpoint has none: its codec is built in)."""
    from .codec import CODEC_CONFIG_FILE, build_config, config_to_dict

    text = json.dumps(config_to_dict(build_config(tiny_codec(cfg))), indent=2)
    (directory / CODEC_CONFIG_FILE).write_text(text, encoding="utf-8")


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (256 byte symbols, no merges) plus the Higgs special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL_TOKENS])
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer needs {tok.get_vocab_size()} ids, text vocab is {vocab_size}")
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_checkpoint(
    directory: str | Path,
    cfg: TalkerConfig | None = None,
    seed: int = 0,
    shards: int = 1,
    eoc_bias: float = 2.5,
    codec: bool = True,
) -> Path:
    """Write a complete checkpoint directory (config, weights, tokenizer, tiny codec) for ``cfg`` (default: tiny)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = cfg or tiny_config()
    (directory / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2), encoding="utf-8")
    save_checkpoint(tiny_weights(cfg, seed=seed, eoc_bias=eoc_bias, codec=codec), directory, shards=shards)
    if codec:
        write_codec_config(directory, cfg)
    write_tokenizer(directory, cfg.text.vocab_size)
    return directory


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "higgs_talker"


def tiny_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """Path of the embedded default checkpoint, building it (atomically) on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-v{RECIPE_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    try:
        write_checkpoint(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

"""Checkpoint directories that both stages of vllm-omni's Higgs-Audio V3 pipeline load: our talker's weights plus a
random codec in the real checkpoint's layout.

Stage 1 of vllm-omni (``HiggsAudioV3Code2Wav``) builds its decoder from the checkpoint's keys under
``tied.embedding.modality_embeddings.0.model.`` with sizes it hard-codes (8 codebooks of 1024 x 64, a DAC
decoder of width 1024 and hop 960) and refuses a missing or unexpected decoder key; it resolves the config
through its own ``HiggsAudioV3Config``, which reads ``<|tts|>``, ``<|text|>``, ``<|audio|>`` from the tokenizer.
Our tiny codec (``codec.TINY_CODEC``, with ``codec_config.json``) is not that layout, so these directories carry
the 4B checkpoint's decode-side codec instead (``codec.HIGGS_V3_CODEC``: 21.6M values, BF16 as the real
checkpoint stores them, no ``codec_config.json``): ``quantizer.quantizers.{i}.codebook.embed`` (transformers'
name, which vllm-omni also accepts; vllm-omni's other spelling ``codebook.weight`` our loader would refuse),
``.project_out.{weight,bias}``, ``fc2`` (1024 -> 256) and ``acoustic_decoder.*`` (transformers' ``DacDecoder``
names with weight-norm parametrizations). Nothing of the layout can be made smaller: vllm-omni fixes every size
but the RVQ width, and our codec derives that from the DAC and HuBERT sizes (256 + 768).

The codec goes in its own shard, ``model-codec.safetensors``, and every key is listed in
``model.safetensors.index.json`` (written when the talker was a single file): vLLM loads only the shards the index
names. Codebook 0's EOC is suppressed (the random weights would otherwise end streams at random), so
``max_tokens`` sets every length.

    python benchmarks/omni_checkpoint.py DIR [--shape small|tiny|4b]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

CODEC_SHARD = "model-codec.safetensors"
# The small shape of the GPU tests (tests/vllm_plugin/test_vllm_gpu.py's ``SHAPE``: head_dim 64, which FlashInfer
# takes), with positions enough for vllm-omni's Stage 1 (max_model_len 65536 in every deploy YAML).
SMALL_TEXT = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=65536)  # fmt: skip
SHAPES = ("tiny", "small", "4b")


def codec_tensors(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The 4B codec's decode-side tensors, random, under the checkpoint's codec prefix (``dtype``)."""
    from higgs_talker.checkpoint import CODEC_PREFIX
    from higgs_talker.codec import HIGGS_V3_CODEC, build_config, random_tensors

    tensors = random_tensors(build_config(HIGGS_V3_CODEC), seed=seed, training_state=False, encoder=False)
    return {CODEC_PREFIX + name: t.to(dtype) for name, t in tensors.items()}


def add_codec(directory: str | Path, seed: int = 0) -> Path:
    """Add the real-layout random codec to a talker checkpoint in ``directory`` (its own shard, listed in the
    index); drops a ``codec_config.json`` (it would describe another codec). Idempotent."""
    from safetensors.torch import save_file

    from higgs_talker.checkpoint import CODEC_PREFIX, INDEX_FILE, SINGLE_FILE, read_header

    directory = Path(directory)
    index_file = directory / INDEX_FILE
    if index_file.is_file():
        index = json.loads(index_file.read_text(encoding="utf-8"))
    elif (directory / SINGLE_FILE).is_file():
        keys = read_header([directory / SINGLE_FILE])
        index = {"metadata": {}, "weight_map": dict.fromkeys(keys, SINGLE_FILE)}
    else:
        raise FileNotFoundError(f"{directory} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    weight_map: dict[str, str] = index["weight_map"]
    other = sorted(k for k, f in weight_map.items() if k.startswith(CODEC_PREFIX) and f != CODEC_SHARD)
    if other:
        raise ValueError(f"{directory} already holds codec keys outside {CODEC_SHARD}: {other[:3]} ...")
    (directory / "codec_config.json").unlink(missing_ok=True)
    if not (directory / CODEC_SHARD).is_file():
        tensors = codec_tensors(seed)
        save_file(tensors, str(directory / CODEC_SHARD), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, CODEC_SHARD)
        files = sorted(set(weight_map.values()))
        index["metadata"]["total_size"] = sum((directory / f).stat().st_size for f in files)
        index_file.write_text(json.dumps(index, indent=2), encoding="utf-8")
    return directory


def small_config(shape: str = "small"):
    """The talker config of ``shape`` ``tiny`` (higgs_talker.tiny's) or ``small`` (head_dim 64, 65536 positions)."""
    from higgs_talker.tiny import tiny_config

    if shape == "tiny":
        return tiny_config(text={"max_position_embeddings": 65536})
    if shape == "small":
        return tiny_config(text=SMALL_TEXT)
    raise ValueError(f"small_config: shape {shape!r} is not 'tiny' or 'small'")


def write_omni_checkpoint(directory: str | Path, shape: str = "small", seed: int = 0) -> Path:
    """A checkpoint directory for vllm-omni's two stages: talker weights of ``shape`` (``tiny`` / ``small``: the
    tiny recipe's fp32 weights with the EOC pushed down, on CPU; ``4b``: bench_vllm's random bf16 4B, drawn on
    the GPU) plus the real-layout random codec. Reuses a finished directory."""
    from higgs_talker.tiny import write_checkpoint

    directory = Path(directory)
    if shape not in SHAPES:
        raise ValueError(f"write_omni_checkpoint: shape {shape!r} is not one of {SHAPES}")
    if (directory / CODEC_SHARD).is_file() and (directory / "config.json").is_file():
        return directory
    if shape == "4b":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_vllm import write_random_checkpoint

        write_random_checkpoint(directory, seed=seed)
    else:
        # eoc_bias < 0: the tiny recipe's bias channel, which makes codebook 0's EOC likely, now makes it unlikely
        write_checkpoint(directory, small_config(shape), seed=seed, shards=2, eoc_bias=-5.0, codec=False)
    return add_codec(directory, seed=seed)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--shape", choices=SHAPES, default="small")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_omni_checkpoint(args.directory, args.shape, args.seed))


if __name__ == "__main__":
    main()

"""The plugin reads config.json as the direct engine does, on a terse config that leaves fields to their defaults:
no ``audio_encoder_config`` (the codebooks and an untied audio head named by the legacy top-level fields), no
``tie_word_embeddings`` in ``text_config`` (the checkpoint has no text head: tied) and no ``head_dim`` (128, as in
transformers' Qwen3Config, while hidden / heads is 16). vllm-omni's config class writes its own defaults into
``to_dict()`` (an audio sub-dict that ties the audio head, transformers' untied text head), so a plugin that read
that would skip the audio head and give other codes, or refuse the checkpoint. Served by plain ``vllm.LLM`` on CPU
(serve_tiny.py); every request's codes equal the direct float32 engine's."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config")

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _served import run_served, spec_params  # noqa: E402

from higgs_talker import HiggsTalker  # noqa: E402
from higgs_talker.tiny import tiny_config, write_checkpoint  # noqa: E402

SCRIPT = Path(__file__).with_name("serve_tiny.py")
SHAPE = dict(text=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_hidden_layers=2),
             num_codebooks=4, tie_modality_embeddings=False)  # fmt: skip
SPEC = [
    {"key": "greedy", "text": "Hello there.", "max_tokens": 30},
    {"key": "seeded", "text": "Say it again, a little longer.", "temperature": 1.0, "seed": 3, "max_tokens": 30},
]


def terse(raw: dict) -> dict:
    """config.json with the fields above left to their defaults, and the legacy top-level audio fields."""
    audio = raw.pop("audio_encoder_config")
    raw |= {"num_codebooks": audio["num_codebooks"], "codebook_size": audio["vocab_size"],
            "tie_modality_embeddings": audio["tie_word_embeddings"]}  # fmt: skip
    for key in ("tie_word_embeddings", "head_dim"):
        del raw["text_config"][key]
    return raw


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = write_checkpoint(tmp_path_factory.mktemp("terse") / "ckpt", tiny_config(**SHAPE), eoc_bias=1.5)
    config = ckpt / "config.json"
    config.write_text(json.dumps(terse(json.loads(config.read_text()))))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return ckpt, run_served([sys.executable, str(SCRIPT), str(ckpt), json.dumps(SPEC)], env)


def test_a_terse_config_means_the_same_to_the_plugin_and_the_direct_engine(served):
    ckpt, got = served
    assert "modality_head.weight" in set(got["loaded"]) and "lm_head.weight" not in set(got["loaded"])
    talker = HiggsTalker.from_pretrained(ckpt, max_num_seqs=2, max_model_len=1024, codec=False)
    cfg = talker.cfg
    assert (cfg.num_codebooks, cfg.text.head_dim, cfg.tie_modality_embeddings, cfg.text.tie_word_embeddings) == (
        4, 128, False, True)  # fmt: skip
    for spec, result in zip(SPEC, got["results"], strict=True):
        want = talker.generate(spec["text"], spec_params(spec, talker))
        rows = torch.tensor(result["rows"], dtype=torch.long)
        assert rows.shape == want.rows.shape and torch.equal(rows, want.rows.long()), spec["key"]

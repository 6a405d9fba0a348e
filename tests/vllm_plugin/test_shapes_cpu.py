"""The plugin on a checkpoint shape other than the tiny one, served by plain ``vllm.LLM`` on CPU (serve_tiny.py):
12 codebooks of 2050 codes, head_dim 64 with hidden / heads = 16 (q_size 384 != hidden 96), GQA 6 / 3, attention
bias, untied text and audio heads, 2 layers, a text vocab that is not a multiple of 64. Every parameter is loaded
and every request's codes (greedy and seeded, of different lengths, voice clones among them) equal the direct
float32 engine's."""

from __future__ import annotations

import pytest

# skips the module cleanly where vLLM is not installed (the core test environment)
pytest.importorskip("vllm.config")

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _served import run_served, spec_params, spec_reference  # noqa: E402

from higgs_talker import HiggsTalker  # noqa: E402
from higgs_talker.tiny import tiny_config, write_checkpoint  # noqa: E402

SCRIPT = Path(__file__).with_name("serve_tiny.py")
SHAPE = dict(
    text=dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=64, num_hidden_layers=2,
              attention_bias=True, tie_word_embeddings=False, vocab_size=301),
    num_codebooks=12, codebook_size=2050, boc_id=2048, eoc_id=2049, tie_modality_embeddings=False,
)  # fmt: skip
SPEC = [
    {"key": "seeded-a", "text": "Hello there.", "temperature": 1.0, "seed": 3, "max_tokens": 60},
    {"key": "seeded-clone", "text": "Say it again.", "temperature": 1.0, "seed": 5, "max_tokens": 30,
     "reference": {"seed": 9, "frames": 5, "text": None}},
    {"key": "greedy-short", "text": "Short.", "max_tokens": 30},
    {"key": "greedy-long", "text": "Hello there, this prompt is a fair bit longer than the others.", "max_tokens": 40},
    {"key": "clone", "text": "Say it like me.", "max_tokens": 30,
     "reference": {"seed": 4, "frames": 6, "text": "Some reference words"}},
]  # fmt: skip


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    # codebook 0's EOC bias of 1.5 (2.5 by default): with this shape greedy-short ends at its EOC, the others run
    # to their caps (2.5 ended every request after one frame)
    ckpt = write_checkpoint(tmp_path_factory.mktemp("shape") / "ckpt", tiny_config(**SHAPE), eoc_bias=1.5)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return ckpt, run_served([sys.executable, str(SCRIPT), str(ckpt), json.dumps(SPEC)], env)


def test_another_shape_loads_every_parameter_and_gives_the_direct_engines_codes(shaped):
    ckpt, served = shaped
    loaded = set(served["loaded"])
    for name in ("model.layers.1.self_attn.qkv_proj.bias", "lm_head.weight", "modality_head.weight"):
        assert name in loaded, name
    talker = HiggsTalker.from_pretrained(ckpt, max_num_seqs=2, max_model_len=1024, codec=False)
    audio, eos = served["specials"]["audio"], served["specials"]["eos"]
    finished_by_eoc, codes = 0, set()
    for spec, got in zip(SPEC, served["results"], strict=True):
        want = talker.generate(spec["text"], spec_params(spec, talker), reference=spec_reference(spec, talker.cfg))
        rows = torch.tensor(got["rows"], dtype=torch.long)
        assert rows.shape == want.rows.shape and rows.shape[1] == 12, (spec["key"], rows.shape, want.rows.shape)
        assert torch.equal(rows, want.rows.long()), spec["key"]
        tail = [eos] if want.finish_reason == "eoc" else []
        assert got["token_ids"] == [audio] * want.num_rows + tail, spec["key"]
        finished_by_eoc += want.finish_reason == "eoc"
        codes |= set(rows.unique().tolist())
    assert finished_by_eoc >= 1  # the EOC / forced-EOS path ran on this shape too
    assert len(codes) > 300  # spread over the 2048 real codes, not a few repeated ones

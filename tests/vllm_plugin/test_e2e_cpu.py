"""End to end inside real vLLM on CPU: the tiny checkpoint served by ``vllm.LLM`` through our registered class.

This is the *text-only* vLLM path: plain vLLM's runner and sampler, with the ``TextOnlyBridge`` logits
processor standing in for the vllm-omni runner (request identity, per-request sampling params). It runs for
real: plugin discovery, architecture resolution, ``load_weights`` on the real checkpoint layout (codec keys
skipped, q/k/v and gate/up packed by vLLM's loaders), vLLM's Qwen3 attention/KV cache/scheduler with chunked
prefill and requests finishing at different steps, audio feedback, the forced ``<|audio|>``/EOS text token
sampled by vLLM's sampler, the text-head skip, code sampling and the delay state. It does not run the
vllm-omni runner's own calls (``sample()``, ``postprocess``/``make_omni_output``, ``model_intermediate_buffer``
voice-clone inputs): those are driven directly in test_adapter.py.
"""

from __future__ import annotations

import pytest

# skips the module cleanly where vLLM is not installed (the core test environment)
pytest.importorskip("vllm.config")

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _reference_check import ScoreBound, ScoreCheck, broken_checkpoint  # noqa: E402
from _served import run_served, spec_params, spec_reference  # noqa: E402

from higgs_talker import HiggsTalker  # noqa: E402

sys.path.insert(0, str(Path(__file__).with_name("score_probe")))
import higgs_score_probe  # noqa: E402

SCRIPT = Path(__file__).with_name("serve_tiny.py")
VOICE_A = {"seed": 11, "frames": 140, "text": "Reference"}
VOICE_B = {"seed": 12, "frames": 140, "text": "Reference"}
# Seeds 1 and 3 make the tiny model sample EOC early (65 and 22 rows), so the EOS path runs too. The seeded
# prompts come first so that only greedy prompts are ever split by chunked prefill: vLLM 0.30's CPU runner
# cannot rewind a seeded request's CPU generator after a partial prefill ("CPU Generator does not use
# offset"), a vLLM limitation unrelated to the talker.
SPEC = [
    {"key": "seed3", "text": "Hello there.", "temperature": 1.0, "seed": 3, "max_tokens": 100},
    {"key": "seed1", "text": "Hello there.", "temperature": 1.0, "seed": 1, "max_tokens": 100},
    {
        "key": "topkp",
        "text": "Top k and top p.",
        "temperature": 0.8,
        "top_k": 50,
        "top_p": 0.9,
        "seed": 7,
        "max_tokens": 30,
    },  # noqa: E501
    {"key": "short", "text": "Short.", "max_tokens": 12},
    {"key": "greedy-long", "text": "Hello there, this prompt is long enough to be chunked.", "max_tokens": 40},
    {"key": "clone", "text": "Say it like me.", "max_tokens": 30,
     "reference": {"seed": 4, "frames": 5, "text": "Some reference words"}},
    # Two voices of one length with one text, and the first voice again with other words, once it has finished
    # (wave 1): 147 placeholder rows, so that vLLM's prefix cache (on by default; 128-token blocks on CPU) holds
    # a full block of the first voice's reference when the others start. Only the prompts' cache_salt tells the
    # voices apart there (SPEC 3.1: their placeholder ids are the same).
    {"key": "voice-a", "text": "Same words.", "max_tokens": 20, "reference": VOICE_A},
    {"key": "voice-b", "text": "Same words.", "max_tokens": 20, "reference": VOICE_B, "wave": 1},
    {"key": "voice-a-again", "text": "Other words, same voice.", "max_tokens": 20, "reference": VOICE_A, "wave": 1},
]  # fmt: skip
BUDGET = 64  # tokens per step: the first step ends part-way through greedy-long's prompt


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    """SPEC served with vLLM's engine core in its own process, where the score probe (score_probe/, through its
    sitecustomize) records what vLLM's sampler ranked, as it does inside vllm-omni's Stage-0 worker on the GPU."""
    scores = tmp_path_factory.mktemp("scores")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           **higgs_score_probe.probe_env(scores)}  # fmt: skip
    # the step budget forces chunked prefill of the long prompt next to decoding requests
    out = run_served([sys.executable, str(SCRIPT), str(tiny_dir), json.dumps(SPEC), str(BUDGET)], env)
    return out | {"records": higgs_score_probe.load(scores)}


def test_the_score_probe_recorded_every_row_in_the_engine_process(served):
    records = served["records"]
    assert sorted(records) == sorted(s["key"] for s in SPEC)
    for got in served["results"]:
        record = records[got["key"]]
        assert record["rows"].tolist() == got["rows"], got["key"]
        assert record["scaled"].shape[:2] == (len(got["rows"]), 8)
        assert record["scaled"].isfinite().any(dim=-1).all(), "a recorded row ranked no code"


# float32 on both sides (vLLM's CPU kernels, our torch ones, hidden 64, 3 layers): their scores differ by summation
# order only (measured over SPEC: worst row 3.9e-7, overall 2.6e-7); layer 1's o_proj x 1.05 or down_proj x 0.95
# moves them by 0.015 (worst row) / 0.010 (overall) over seed3 and greedy-long (the mutation test below)
FP32_BOUND = ScoreBound(row=1e-5, overall=1e-5, code=1e-5)


def test_vllms_own_scores_equal_the_float32_engines(served, tiny_dir):
    """What vLLM's sampler ranked at every row of every request (recorded inside vLLM) against our float32 engine
    teacher-forced on vLLM's rows: the check the GPU suite runs with bf16 bounds, here at float32's."""
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=2, max_model_len=1024)
    check = ScoreCheck(talker, FP32_BOUND)
    for spec, got in zip(SPEC, served["results"], strict=True):
        rows = torch.tensor(got["rows"], dtype=torch.long)
        scaled = served["records"][spec["key"]]["scaled"]
        prompt = talker.build_prompt(spec["text"], spec_reference(spec, talker.cfg))
        check.check_scores(prompt, spec_params(spec, talker), rows, scaled, spec["key"])
    assert 0 < check.worst_row <= FP32_BOUND.row


@pytest.fixture(scope="module")
def served_broken(tiny_dir, tmp_path_factory):
    """The tiny checkpoint with layer 1's o_proj x 1.05 served by vLLM, its sampler's scores recorded."""
    tmp = tmp_path_factory.mktemp("broken")
    ckpt = broken_checkpoint(tiny_dir, tmp / "ckpt", "o_proj", 1, 1.05)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HIGGS_RECORD_SCORES": str(tmp / "scores.pt")}  # fmt: skip
    spec = [s for s in SPEC if s["key"] in ("seed3", "greedy-long")]
    out = run_served([sys.executable, str(SCRIPT), str(ckpt), json.dumps(spec), str(BUDGET)], env)
    return out | {"scores": torch.load(tmp / "scores.pt"), "spec": spec}


def test_the_score_check_fails_a_vllm_model_off_by_5_percent(served_broken, tiny_dir):
    """The mutation test of the check above: vLLM serving one projection 5% off fails it on every request."""
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=2, max_model_len=1024)
    for spec, got in zip(served_broken["spec"], served_broken["results"], strict=True):
        rows, scaled = torch.tensor(got["rows"], dtype=torch.long), served_broken["scores"][spec["key"]]
        prompt, params = talker.build_prompt(spec["text"], spec_reference(spec, talker.cfg)), spec_params(spec, talker)
        with pytest.raises(AssertionError, match="from the float32 reference|far from the reference"):
            ScoreCheck(talker, FP32_BOUND).check_scores(prompt, params, rows, scaled, spec["key"])


def test_our_class_serves_and_loads_every_parameter(served):
    assert served["arch_class"] == "higgs_talker.vllm_plugin.talker:HiggsTalkerForConditionalGeneration"
    loaded = set(served["loaded"])
    assert "multimodal_embedding.weight" in loaded and "model.layers.0.self_attn.qkv_proj.weight" in loaded
    assert not any(n.startswith("tied.") for n in loaded)
    assert "local MLP graphs on" in served["graph_decision"]  # enforce_eager: vLLM captures nothing


@pytest.mark.parametrize("index", range(len(SPEC)), ids=[s["key"] for s in SPEC])
def test_codes_match_the_direct_engine(served, tiny_dir, index):
    spec, got = SPEC[index], served["results"][index]
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=2, max_model_len=1024)
    want = talker.generate(spec["text"], spec_params(spec, talker), reference=spec_reference(spec, talker.cfg))
    rows = torch.tensor(got["rows"], dtype=torch.long)
    assert rows.shape == want.rows.shape
    assert torch.equal(rows, want.rows)
    audio, eos = served["specials"]["audio"], served["specials"]["eos"]
    if want.finish_reason == "eoc":  # terminal row, then one forced EOS step that stops the request
        assert got["finish_reason"] == "stop"
        assert got["token_ids"] == [audio] * want.num_rows + [eos]
    else:
        assert got["finish_reason"] == "length"
        assert got["token_ids"] == [audio] * want.num_rows


def test_prefix_cache_shares_a_voice_only_with_itself(served):
    """voice-b started after voice-a had finished, with the same token ids for 147 positions: vLLM's prefix cache
    gave it nothing (the salts differ), while voice-a-again reused voice-a's first block (the same salt). Their
    codes equal the direct engine's for each alone (test_codes_match_the_direct_engine)."""
    cached = {r["key"]: r["num_cached_tokens"] for r in served["results"]}
    assert cached["voice-b"] == 0, cached
    assert cached["voice-a-again"] >= 128, cached


def test_pure_audio_steps_skipped_the_text_head(served):
    stats = served["stats"]
    assert stats["text_head_skipped"] > stats["text_head_full"] > 0


SEEDED = {"temperature": 1.0, "seed": 3}
PREEMPT_SPEC = [
    {"key": f"p{i}", "text": f"Hello there, request {i}.", "max_tokens": 90, **(SEEDED if i == 1 else {})}
    for i in range(5)
]


@pytest.fixture(scope="module")
def served_with_preemption(tiny_dir):
    """A KV cache of 12 blocks of 32 tokens for five 110-token requests: vLLM preempts and recomputes."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    kwargs = {"max_model_len": 256, "block_size": 32, "num_gpu_blocks_override": 12}
    cmd = [sys.executable, str(SCRIPT), str(tiny_dir), json.dumps(PREEMPT_SPEC), "64", json.dumps(kwargs)]
    return run_served(cmd, env)


def test_preempted_requests_resume_with_their_codes(served_with_preemption, tiny_dir):
    """vLLM removes a preempted request from the batch and recomputes it later from position 0: the bridge kept
    its slot, the recomputed positions are fed their rows again, and every request's codes equal the direct
    engine's."""
    stats = served_with_preemption["stats"]
    assert stats["bridge_recomputed_rows"] > 0, stats  # a preemption really happened and was re-fed
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=2, max_model_len=1024)
    for spec, got in zip(PREEMPT_SPEC, served_with_preemption["results"], strict=True):
        want = talker.generate(spec["text"], spec_params(spec, talker))
        assert torch.equal(torch.tensor(got["rows"], dtype=torch.long), want.rows), spec["key"]

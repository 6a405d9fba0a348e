"""The talker inside real vLLM on a GPU (H200: vLLM 0.26 + FlashInfer, ``../shared/tools/vllm-gpu-bundle.sh``).

A small checkpoint FlashInfer supports (head_dim 64, bf16) is served by ``vllm.LLM`` through the plugin and the
text-only bridge, in both deploy profiles' graph settings:

- ``eager`` (the high-throughput profile: enforce_eager): our local MLP graphs over vLLM's layers are captured
  at load for every bucket, each replay checked against eager, and used in decode steps (counted);
- ``fdo`` (the low-latency profile: FULL_DECODE_ONLY, capture sizes [1, 2, 4, 8, 16]): vLLM captures and
  replays its graphs, our local path never runs (counted), and the bridge serves replayed steps.

Codes must equal our direct engine's on the same GPU; where vLLM's layers and ours round a code differently
(bf16), vLLM's rows are checked against a float32 reference teacher-forced on them (``_reference_check``).
Skipped without CUDA or vLLM.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm.config")

from _reference_check import ScoreCheck, broken_checkpoint, float32_reference, score_bound  # noqa: E402
from _served import run_served, spec_params, spec_reference  # noqa: E402

from higgs_talker import HiggsTalker  # noqa: E402
from higgs_talker.tiny import tiny_config, write_checkpoint  # noqa: E402

SCRIPT = Path(__file__).with_name("serve_tiny.py")
SCRIPT_DP = Path(__file__).with_name("serve_tiny_dp.py")
SPEC = [
    {"key": "greedy-long", "text": "Hello there, this prompt is long enough to be chunked.", "max_tokens": 60},
    {"key": "seeded", "text": "Hello there.", "temperature": 1.0, "seed": 3, "max_tokens": 48},
    {"key": "topkp", "text": "Top k and top p.", "temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 7,
     "max_tokens": 40},
    {"key": "short", "text": "Short.", "max_tokens": 20},
    {"key": "greedy-b", "text": "Another request that joins the batch.", "max_tokens": 33},
    {"key": "clone", "text": "Say it like me.", "max_tokens": 30,
     "reference": {"seed": 4, "frames": 5, "text": "Some reference words"}},
]  # fmt: skip
COMMON = {"dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 16, "gpu_memory_utilization": 0.25,
          "attention_backend": "FLASHINFER", "kernel_config": {"enable_flashinfer_autotune": False}}  # fmt: skip
PROFILES = {
    "eager": {"enforce_eager": True},
    "fdo": {"enforce_eager": False,
            "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}},
}  # fmt: skip
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


SPEC_4B = [
    {"key": "greedy-long", "text": "A longer prompt for the four billion shape, long enough for two chunks.",
     "max_tokens": 40},
    {"key": "seeded", "text": "Hello there.", "temperature": 1.0, "seed": 3, "max_tokens": 30},
    {"key": "topkp", "text": "Top k and top p.", "temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 7,
     "max_tokens": 24},
]  # fmt: skip
# (checkpoint, profile, tensor-parallel size, data-parallel size): the small head_dim-64 checkpoint in both
# profiles, the 4B shape (random bf16 weights, benchmarks/bench_vllm.py's checkpoint) in the high-throughput one;
# with two GPUs, all three again over tensor parallelism (``vllm.LLM``, rows checked on every rank) and over data
# parallelism (``AsyncLLM`` with two engines, ``serve_tiny_dp.py``), codes compared with the one-GPU direct
# engine's.
CASES = {
    "h64-eager": ("h64", "eager", 1, 1), "h64-fdo": ("h64", "fdo", 1, 1), "4b-eager": ("4b", "eager", 1, 1),
    "h64-eager-tp2": ("h64", "eager", 2, 1), "h64-fdo-tp2": ("h64", "fdo", 2, 1), "4b-eager-tp2": ("4b", "eager", 2, 1),
    "h64-eager-dp2": ("h64", "eager", 1, 2), "h64-fdo-dp2": ("h64", "fdo", 1, 2), "4b-eager-dp2": ("4b", "eager", 1, 2),
}  # fmt: skip
SPECS = {"h64": SPEC, "4b": SPEC_4B}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_vllm import write_random_checkpoint

    return {
        "h64": write_checkpoint(tmp_path_factory.mktemp("h64") / "ckpt", tiny_config(text=SHAPE)),
        "4b": write_random_checkpoint(Path(os.environ.get("HIGGS_4B_CKPT", "/tmp/higgs_4b_random"))),
    }


@pytest.fixture(scope="module", params=list(CASES))
def served(request, checkpoints, tmp_path_factory) -> dict:
    name, profile, tp, dp = CASES[request.param]
    if torch.cuda.device_count() < tp * dp:
        pytest.skip(f"needs {tp * dp} GPUs")
    # one GPU: the engine in this process; tensor parallel: vLLM's worker processes (rows come by collective_rpc);
    # data parallel: AsyncLLM's engine processes (rows come from each engine)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if tp * dp == 1 else "1",
           "VLLM_USE_FLASHINFER_SAMPLER": "0"}  # fmt: skip
    kwargs = COMMON | PROFILES[profile] | ({"tensor_parallel_size": tp} if tp > 1 else {})
    if dp > 1:
        kwargs["max_num_batched_tokens"] = 64  # chunked prefill, as serve_tiny's argument below sets it
        cmd = [sys.executable, str(SCRIPT_DP), str(checkpoints[name]), json.dumps(SPECS[name]), str(dp),
               json.dumps(kwargs)]  # fmt: skip
    else:
        cmd = [sys.executable, str(SCRIPT), str(checkpoints[name]), json.dumps(SPECS[name]), "64", json.dumps(kwargs)]
    log_dir = os.environ.get("HIGGS_VLLM_LOG_DIR")  # keep vLLM's own log of each case (the GPU run's evidence)
    log = Path(log_dir, f"serve_{request.param}.log") if log_dir else None
    scores = None
    if tp * dp == 1:  # the engine runs in serve_tiny's process: it records what vLLM's sampler ranked
        scores = tmp_path_factory.mktemp("scores") / "scores.pt"
        env["HIGGS_RECORD_SCORES"] = str(scores)
    out = run_served(cmd, env, timeout=900, log=log) | {"profile": profile, "checkpoint": name}
    return out | {"scores": torch.load(scores) if scores is not None else None}


_SOLO: dict[str, HiggsTalker] = {}
_REFERENCE: dict[int, HiggsTalker] = {}


def _reference(solo: HiggsTalker) -> HiggsTalker:
    """The float32 reference of ``solo``'s weights, built once per solo talker (one at a time)."""
    if id(solo) not in _REFERENCE:
        _REFERENCE.clear()
        _REFERENCE[id(solo)] = float32_reference(solo)
    return _REFERENCE[id(solo)]


def solo_for(checkpoints: dict[str, Path], name: str) -> HiggsTalker:
    """The direct engine on the same GPU, one request at a time, eager (its sampler can be observed); one
    checkpoint loaded at a time."""
    if name not in _SOLO:
        _SOLO.clear()
        torch.cuda.empty_cache()
        _SOLO[name] = HiggsTalker.from_pretrained(checkpoints[name], device="cuda", dtype="bfloat16",
                                                  graph_mode="eager", max_num_seqs=1, max_model_len=512,
                                                  decode_kernel="native")  # fmt: skip
    return _SOLO[name]


@pytest.mark.parametrize("index", range(len(SPEC)), ids=[s["key"] for s in SPEC])
def test_codes_match_the_direct_engine_or_split_at_a_near_tie(served, checkpoints, index):
    specs = SPECS[served["checkpoint"]]
    if index >= len(specs):
        pytest.skip(f"the {served['checkpoint']} case has {len(specs)} requests")
    spec, got = specs[index], served["results"][index]
    solo = solo_for(checkpoints, served["checkpoint"])
    # the same cap for the run and its re-run
    params, reference = spec_params(spec, solo), spec_reference(spec, solo.cfg)
    prompt = solo.build_prompt(spec["text"], reference)
    want = solo.generate(spec["text"], params, reference=reference).rows
    rows = torch.tensor(got["rows"], dtype=torch.long)
    what = f"{served['profile']} {spec['key']}"
    if served["scores"] is not None:
        # what vLLM's sampler ranked at every row (recorded inside vLLM) against the float32 reference
        # teacher-forced on vLLM's rows: vLLM's own bf16 computation within the measured bf16 error, every row
        ScoreCheck(_reference(solo), score_bound(solo)).check_scores(prompt, params, rows,
                                                                     served["scores"][spec["key"]], what)  # fmt: skip
    if not torch.equal(rows, want):
        # every code vLLM took scores near the best of the float32 reference teacher-forced on vLLM's rows, and
        # our kernels (the direct engine, eager) teacher-forced on them stay within the measured bf16 error
        ScoreCheck(_reference(solo), score_bound(solo)).check(solo, prompt, params, rows, what)
    assert rows.shape[0] == spec["max_tokens"] or got["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def served_broken(checkpoints, tmp_path_factory) -> dict:
    """The head_dim-64 checkpoint with layer 1's o_proj x 1.05, served in the FULL-decode-graph profile with its
    sampler's scores recorded: the mutation run of the check above."""
    tmp = tmp_path_factory.mktemp("broken")
    ckpt = broken_checkpoint(checkpoints["h64"], tmp / "ckpt", "o_proj", 1, 1.05)
    spec = [s for s in SPEC if s["key"] in ("greedy-long", "seeded")]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "HIGGS_RECORD_SCORES": str(tmp / "scores.pt")}  # fmt: skip
    cmd = [sys.executable, str(SCRIPT), str(ckpt), json.dumps(spec), "64", json.dumps(COMMON | PROFILES["fdo"])]
    return run_served(cmd, env, timeout=900) | {"scores": torch.load(tmp / "scores.pt"), "spec": spec}


def test_the_score_check_fails_vllm_serving_a_model_off_by_5_percent(served_broken, checkpoints):
    """Every request of the broken model fails the check of vLLM's own scores (against the intact weights'
    float32 reference): rows past the measured bf16 error, or codes far from the reference's best."""
    solo = solo_for(checkpoints, "h64")
    for spec, got in zip(served_broken["spec"], served_broken["results"], strict=True):
        params = spec_params(spec, solo)
        rows, scaled = torch.tensor(got["rows"], dtype=torch.long), served_broken["scores"][spec["key"]]
        with pytest.raises(AssertionError, match="from the float32 reference|far from the reference"):
            ScoreCheck(_reference(solo), score_bound(solo)).check_scores(
                solo.build_prompt(spec["text"]), params, rows, scaled, f"broken {spec['key']}"
            )


def test_the_audio_path_ran_and_the_text_head_was_skipped(served):
    stats = served["stats"]
    assert stats["sample_steps"] > 0 and stats["bridge_no_qsl"] == 0, stats
    assert stats["text_head_skipped"] > stats["text_head_full"] > 0, stats


def test_graph_paths_of_the_profile(served):
    local, stats = served["local_mlp"], served["stats"]
    if served["profile"] == "eager":
        assert "local MLP graphs on" in served["graph_decision"]
        assert local["buckets"] == [1, 2, 4, 8, 16] and not local["failed"]
        assert local["replays"] > 0  # decode steps ran through the captured graphs
        assert stats["bridge_replayed_steps"] == 0
    else:
        assert "local MLP graphs off" in served["graph_decision"] and "FULL_DECODE_ONLY" in served["graph_decision"]
        assert local["buckets"] == [] and local["replays"] == 0  # never captured or replayed inside vLLM's graphs
        assert stats["bridge_replayed_steps"] > 0  # decode steps were vLLM graph replays


@pytest.mark.parametrize("profile", ["high_throughput", "low_latency"])
def test_deploy_profiles_load_as_written(profile):
    """Stage 0 of each packaged deploy YAML is a valid vLLM engine configuration."""
    from vllm.engine.arg_utils import EngineArgs

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_vllm import stage0_engine_args

    from higgs_talker.tiny import tiny_checkpoint

    args = stage0_engine_args(profile, use_trtllm=False)
    args["max_model_len"] = min(args["max_model_len"], 4096)  # the profiles are written for the 4B model
    vc = EngineArgs(model=str(tiny_checkpoint()), **args).create_engine_config()
    assert vc.model_config.enforce_eager is (profile == "high_throughput")
    assert vc.scheduler_config.max_num_seqs == args["max_num_seqs"]

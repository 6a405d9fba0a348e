"""CPU probe: the host time of the Stage-0 -> Stage-1 hand-over a deploy YAML names
(``custom_process_next_stage_input_func``), per step of N requests: vllm-omni's own
``talker2code2wav_async_chunk`` beside ours (``vllm_plugin.deploy``: the same payloads, cut by
``codec.streaming``, with the queued finished flag and the ramp). vllm-omni calls it once per request per step, so
at 64 streams its cost is host time of every step. One row each [1, 8] a call, past the first chunks (steady
state), ramp on, the connector settings of our profiles. Prints; asserts nothing.

    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/probes/handover_host_time.py [N]
"""

import argparse
import collections
import importlib.util
import sys
import timeit
import types
from pathlib import Path

import torch

from higgs_talker.vllm_plugin import deploy

EXTRA = {"codec_chunk_frames": 25, "codec_left_context_frames": 10, "codec_right_holdback_frames": 4,
         "initial_codec_chunk_frames": 1, deploy.RAMP_KEY: True}  # fmt: skip


class Request:
    """What the hand-over reads of a vLLM request."""

    status = types.SimpleNamespace(name="RUNNING")

    def __init__(self, rid: str) -> None:
        self.external_req_id = rid

    def is_finished(self) -> bool:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("n", nargs="?", type=int, default=64, metavar="N", help="requests a step (default 64)")
    n = p.parse_args().n
    if importlib.util.find_spec("vllm_omni") is None:
        sys.exit(f"{Path(__file__).name} times vllm-omni's hand-over beside ours: vllm_omni is not installed here "
                 "(pip install -e '.[vllm]')")  # fmt: skip
    from vllm_omni.model_executor.stage_input_processors import higgs_audio_v3

    requests = [Request(f"r{i}") for i in range(n)]
    rows = torch.randint(0, 1024, (n, 1, 8), dtype=torch.int32)
    for name, hand_over in (("vllm-omni's", higgs_audio_v3.talker2code2wav_async_chunk),
                            ("ours", deploy.talker2code2wav_async_chunk)):  # fmt: skip
        manager = types.SimpleNamespace(connector=types.SimpleNamespace(config={"extra": EXTRA}),
                                        code_prompt_token_ids=collections.defaultdict(list))  # fmt: skip

        def step(manager=manager, hand_over=hand_over) -> None:
            for i, request in enumerate(requests):
                hand_over(manager, {"codes": {"audio": rows[i]}}, request, False)

        for _ in range(60):  # past the ramp: the steady state
            step()
        per_step = min(timeit.repeat(step, number=100, repeat=5)) / 100
        print(f"{name:12s} {per_step * 1e3:6.3f} ms a step of {n} requests ({per_step / n * 1e6:5.1f} us a call)")


if __name__ == "__main__":
    main()

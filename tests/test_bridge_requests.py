"""The text-only bridge's request bookkeeping (``heads.bridge_requests``), without vLLM: vLLM's batch updates are
played by a stand-in of ``process_dict_updates`` (adds, then removals; tests/vllm_plugin/test_bridge.py runs vLLM's)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from higgs_talker.heads.bridge_requests import REFERENCE, REQUEST_KEY, BridgeRequests, request_args, unsupported


def params(key=None, seed=None, **kw):
    base = dict(temperature=0.7, top_k=50, top_p=0.9, seed=seed, min_tokens=3, n=1, allowed_token_ids=None)
    return NS(**(base | {"extra_args": {} if key is None else {REQUEST_KEY: key}} | kw))


def edit(by_index, update, new_state):
    for index, p, prompt, output in update.added:
        by_index[index] = new_state(p, prompt, output)
    for index in update.removed:
        by_index.pop(index, None)


def update(size, added=(), removed=()):
    return NS(batch_size=size, added=list(added), removed=list(removed))


def test_keys_seeds_and_parameters_in_batch_order():
    reqs = BridgeRequests()
    assert reqs.update(edit, update(2, [(1, params("b", seed=7), [1], []), (0, params("a"), [1], [])])) == ([], set())
    keys, seeds, min_rows, refs = reqs.arguments()
    assert (keys, seeds, min_rows, refs) == (["a", "b"], {1: 7}, {0: 3, 1: 3}, [{}, {}])
    temperature, top_k, top_p = reqs.params(torch.device("cpu"))
    assert temperature.tolist() == pytest.approx([0.7, 0.7]) and top_k.tolist() == [50, 50]


def test_a_live_key_is_made_unique_and_a_resumed_request_named_by_its_new_key(caplog):
    reqs = BridgeRequests()
    reqs.update(edit, update(1, [(0, params("a"), [1], [])]))
    gone, resumed = reqs.update(edit, update(2, [(1, params("a"), [1], [5, 6])]))
    first, second = reqs.arguments()[0]
    assert gone == [] and first == "a" and second.startswith("a#") and resumed == {second}
    assert second in caplog.text
    assert reqs.update(edit, update(1, [(0, params("c"), [1], [])], removed=[1])) == (["a", second], set())


def test_a_request_without_a_key_gets_an_internal_one():
    reqs = BridgeRequests()
    reqs.update(edit, update(1, [(0, params(), [1], [])]))
    assert reqs.arguments()[0][0].startswith("vllm-bridge-")


def test_request_args_carry_the_reference_rows_in_the_keys_the_adapter_reads():
    prompt = NS(audio_codes=torch.tensor([[1, 2]]), audio_positions=torch.tensor([4]))
    args = request_args("k", prompt)
    assert args == {REQUEST_KEY: "k", REFERENCE: {"rows": [[1, 2]], "positions": [4]}}
    added = BridgeRequests().added(params(extra_args=args), [1], None)
    assert added.reference == {"audio_input_ids": [[1, 2]], "audio_placeholder_positions": [4]}


@pytest.mark.parametrize(
    ("kw", "phrase"),
    [
        ({"n": 2}, "n=2"),
        ({"allowed_token_ids": [5]}, "allowed_token_ids"),
        ({"structured_outputs": "a+"}, "structured outputs"),
    ],
)
def test_what_the_bridge_cannot_honour_is_named(kw, phrase):
    assert unsupported(params("k")) == []
    (problem,) = unsupported(params("k", **kw))
    assert problem.startswith(phrase)

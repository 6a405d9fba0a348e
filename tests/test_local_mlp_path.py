"""``cuda_graphs.local_mlp.LocalMLPPath`` (the vLLM adapter's local MLP graphs over a foreign layer stack) on CPU,
with a stand-in for the capture (``_stand_in_graphs``): graphed layers equal the eager stack, and every step the
path does not cover comes back as None."""

from __future__ import annotations

import torch
from _stand_in_graphs import stand_in_capture
from torch import nn

from higgs_talker.cuda_graphs import local_mlp as local_module
from higgs_talker.cuda_graphs.local_mlp import LocalMLPGraphs, LocalMLPPath
from higgs_talker.model import forward_layers

H = 8


class _Norm(nn.Module):
    """A fused-add norm with a Qwen3 layer's calling convention."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H))

    def forward(self, x, residual=None):
        if residual is None:
            return x * self.weight
        total = x + residual
        return total * self.weight, total


class _Attention(nn.Module):
    def forward(self, positions, hidden_states):
        return hidden_states + positions[:, None].float()


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _Norm(), _Norm()
        self.self_attn, self.mlp = _Attention(), nn.Linear(H, H)


def _path(monkeypatch, enabled=True, forward_context=None):
    torch.manual_seed(0)
    layers, norm = [_Layer() for _ in range(3)], _Norm()
    path = LocalMLPPath(layers, norm, enabled, max_batch=4, forward_context=forward_context)
    monkeypatch.setattr(local_module, "capture_graph", stand_in_capture)
    graphs = LocalMLPGraphs(path._post_attention, len(layers), [1, 2, 4], pool=0,  # no CUDA pool on CPU
                            forward_context=forward_context)  # as capture() makes them  # fmt: skip
    with torch.inference_mode():
        graphs.capture(H, torch.float32, torch.device("cpu"))
    path.graphs = graphs  # capture() itself only captures on CUDA
    return path, layers, norm


def test_the_graphed_stack_equals_the_eager_layers_and_counts_its_replays(monkeypatch):
    path, layers, norm = _path(monkeypatch)
    embeds, positions = torch.randn(3, H), torch.tensor([5, 9, 2])
    with torch.inference_mode():
        got = path.forward(positions, embeds, pure_decode=True)
        want = norm(*forward_layers(layers, positions, embeds))[0]
    torch.testing.assert_close(got, want)
    assert path.replays == 1 and path.graphs.sizes == (1, 2, 4)
    assert path.report() == {"replays": 1, "buckets": [1, 2, 4], "failed": {}}


def test_steps_the_graphs_do_not_cover_return_none(monkeypatch):
    path, _, _ = _path(monkeypatch)
    positions = torch.arange(5)
    assert path.forward(positions[:3], torch.randn(3, H), pure_decode=False) is None  # a prefill in the step
    assert path.forward(positions, torch.randn(5, H), pure_decode=True) is None  # larger than every bucket
    full = type("Ctx", (), {"cudagraph_runtime_mode": type("Mode", (), {"name": "FULL"})()})()
    guarded, _, _ = _path(monkeypatch, forward_context=lambda: full)
    assert guarded.forward(positions[:2], torch.randn(2, H), pure_decode=True) is None  # vLLM replays FULL
    assert path.replays == 0 and guarded.replays == 0


def test_capture_only_when_enabled_and_on_cuda():
    path = LocalMLPPath([_Layer()], _Norm(), enabled=True, max_batch=4)
    path.capture(H, torch.zeros(1))  # a CPU tensor: nothing captured
    off = LocalMLPPath([_Layer()], _Norm(), enabled=False, max_batch=4)
    off.capture(H, torch.zeros(1))
    assert path.graphs is None and off.graphs is None
    assert path.report() == {"replays": 0, "buckets": [], "failed": {}}
    assert path.forward(torch.arange(1), torch.randn(1, H), pure_decode=True) is None


def test_a_forward_replays_each_layers_graph_of_its_bucket_once(monkeypatch):
    """``step_hook`` settles the bucket once a forward: 3 rows replay bucket 4's graph of every layer exactly once
    (and no other bucket's), through the same static views each time; 5 rows (no bucket) or a guard that says no
    get the eager block."""
    path, layers, norm = _path(monkeypatch)
    graphs = path.graphs
    embeds, positions = torch.randn(3, H), torch.tensor([5, 9, 2])

    def replays():
        return {size: [g.replays for g in b.graphs] for size, b in graphs.buckets.items()}

    before = replays()
    with torch.inference_mode():
        path.forward(positions, embeds, pure_decode=True)
        path.forward(positions, embeds, pure_decode=True)
    after = replays()
    assert after[4] == [n + 2 for n in before[4]] and after[1] == before[1] and after[2] == before[2]
    assert graphs.buckets[4].views(3) is graphs.buckets[4].views(3)  # cut once, reused by every replay
    assert graphs.step_hook(5) is graphs.post_attention
    full = type("Ctx", (), {"cudagraph_runtime_mode": type("Mode", (), {"name": "FULL"})()})()
    graphs.forward_context = lambda: full
    assert graphs.step_hook(3) is graphs.post_attention

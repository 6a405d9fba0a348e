"""The decode-kernel choice (``cuda_graphs.kernels``) on CPU: which kernel a table of measurements picks, the
synthetic batches it measures on, and the whole-step function the graph runner gives it. The measurement itself
needs CUDA graphs (``tests/test_gpu.py``)."""

from __future__ import annotations

import torch

from higgs_talker import HiggsTalker
from higgs_talker.cuda_graphs import GraphRunner
from higgs_talker.cuda_graphs.kernels import pick_kernels, step_context, synthetic_batch
from higgs_talker.kv_cache import kv_slot

KERNELS = ("native_tc", "native_tc_nosplit", "xqa")


def row(bucket, context, kernel, step_ms, ok=True, us=1.0):
    return {"bucket": bucket, "context": context, "kernel": kernel, "step_ms": step_ms, "us": us, "ok": ok}


def test_the_least_total_step_time_over_contexts_wins():
    rows = [
        row(1, 512, "native_tc", 3.0), row(1, 2048, "native_tc", 3.2),
        row(1, 512, "native_tc_nosplit", 2.9), row(1, 2048, "native_tc_nosplit", 3.5),  # faster short, slower long
        row(1, 512, "xqa", 3.3), row(1, 2048, "xqa", 3.3),
        row(64, 512, "native_tc", 5.1), row(64, 2048, "native_tc", 9.0),
        row(64, 512, "native_tc_nosplit", 5.2), row(64, 2048, "native_tc_nosplit", 8.0),
        row(64, 512, "xqa", 5.6), row(64, 2048, "xqa", 8.5),
    ]  # fmt: skip
    assert pick_kernels(rows, KERNELS, "step_ms") == {1: "native_tc", 64: "native_tc_nosplit"}
    # by the time alone instead: every kernel 1 us, so the first one
    assert pick_kernels(rows, KERNELS, "us") == {1: "native_tc", 64: "native_tc"}


def test_a_kernel_rejected_at_one_context_is_never_chosen_and_ties_keep_the_order():
    rows = [
        row(8, 512, "native_tc", 4.0), row(8, 2048, "native_tc", 4.0),
        row(8, 512, "native_tc_nosplit", 1.0), row(8, 2048, "native_tc_nosplit", 1.0, ok=False),
        row(8, 512, "xqa", 2.0), row(8, 2048, "xqa", 6.0),
    ]  # fmt: skip
    assert pick_kernels(rows, KERNELS, "step_ms") == {8: "native_tc"}  # 8.0 vs inf vs 8.0: the earlier one
    nothing = [row(2, 512, k, 1.0, ok=False) for k in KERNELS]
    assert pick_kernels(nothing, KERNELS, "step_ms") == {2: "native_tc"}


def test_synthetic_batches_decode_the_last_position_and_wrap_around_the_pool():
    batch = synthetic_batch(3, 40, 16)
    assert batch.block_tables == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert batch.positions == [39] * 3 and batch.seq_lens == [40] * 3 and batch.query_lens == [1] * 3
    assert batch.slot_mapping == [kv_slot(t, 39, 16) for t in batch.block_tables]
    wrapped = synthetic_batch(3, 40, 16, num_blocks=4)
    assert wrapped.block_tables == [[0, 1, 2], [3, 0, 1], [2, 3, 0]]
    assert all(0 <= s < 4 * 16 for s in wrapped.slot_mapping)


def test_whole_step_timings_give_each_request_blocks_of_its_own():
    """The context a whole-step timing uses: the one asked for, or the longest whose requests' blocks all fit the
    pool (blocks shared between requests are read from L2, which flattered FlashInfer at 64 x 2,048 on an H100)."""

    class Pool:
        kv_caches = [torch.zeros(1, 2, 16, 1, 8)]  # block size 16
        scratch_block = 4096  # the pool's blocks

    assert [step_context(Pool, b, 2048) for b in (1, 16, 32, 64)] == [2048, 2048, 2048, 1024]
    assert step_context(Pool, 64, 512) == 512 and step_context(Pool, 8192, 512) == 1  # a batch past the pool
    for b, ctx in ((64, 2048), (48, 2048), (3, 40)):
        used = -(-step_context(Pool, b, ctx) // 16) * b
        assert used <= Pool.scratch_block or step_context(Pool, b, ctx) == 1


def test_the_runners_kernel_step_runs_the_whole_step_on_the_scratch_slot(tiny_dir):
    talker = HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=4, max_model_len=256)
    runner = talker.engine.runner
    graphs = GraphRunner(runner, "eager", (1, 2, 4), 4)
    attn = runner.attn
    batch = synthetic_batch(4, 100, runner.block_size, num_blocks=attn.scratch_block)
    attn.plan_bucket(batch)
    state = runner.slots.state
    before = [t.clone() for t in (state.last_codes, state.has_codes, runner.slots.num_rows)]
    step = graphs._kernel_step(batch)
    with runner.slots.preserved([runner.slots.scratch]):
        rows = step()
    c = talker.cfg.num_codebooks
    assert rows.shape == (4, c + 1) and rows[:, :c].min() >= 0 and rows[:, :c].max() <= talker.cfg.eoc_id
    after = [state.last_codes, state.has_codes, runner.slots.num_rows]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # no request slot was touched


def test_flashinfer_is_not_asked_for_a_head_size_it_does_not_serve(monkeypatch, caplog):
    """FlashInfer's FA2 prefill is right only at multiples of 64 (flashinfer#4299: an illegal memory access, or wrong
    rows); the tiny checkpoint's heads are 32 wide. On CUDA such a model gets the torch kernels and SDPA, one
    warning naming the size; a served size still asks for FlashInfer."""
    import logging

    from higgs_talker import ops

    built = []
    monkeypatch.setattr(ops, "FlashInferKernels", lambda *args: built.append(args) or "flashinfer kernels")
    with caplog.at_level(logging.WARNING, logger="higgs_talker.ops"):
        assert isinstance(ops.default_kernels("cuda", True, "auto", head_dim=32), ops.TorchKernels)
    assert not built and "head_dim 32" in caplog.text and "64/128/256" in caplog.text
    for head_dim in (64, 128, 256, None):
        assert ops.default_kernels("cuda", True, "auto", head_dim=head_dim) == "flashinfer kernels"
    assert ops.default_kernels("cpu", head_dim=128).name == "torch"

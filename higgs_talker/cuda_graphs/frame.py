"""Frame graphs for the vLLM adapter: one step's frame work (``heads.spans.frame_results``: codebook head, masks,
sampler, state update, the results row) replayed from a CUDA graph per batch bucket.

Eagerly that work is a few hundred small launches: on the H200 its host time is about 2.25 ms a step at batch 1
and at 16 (``sample`` in the step-timing probe, and the same pieces alone with torch's sync debug mode finding no
synchronizing call), more than half of a 4B decode step's device time. vLLM's FULL decode graph covers the
forward only; the adapter's sampling runs after it, outside any capture.

Each bucket has static inputs (slots, hidden rows, tail tokens and positions, the front end's sampling parameters)
and one static output (the results): the rows' classification and the parameters' normalization run inside the
graph too. Rows past the batch are padding: they sit in the store's scratch slot, with a tail that is no token and
no position, and produce nothing. Captured after the weights are loaded (largest bucket first, one pool), each
bucket is replayed once on random rows of the scratch slot and compared with an eager run from the same state; any
difference, or any error, leaves that bucket eager with one warning (``capture.capture_buckets``). ``run`` returns
None (run eagerly) for a batch no bucket holds and while a stream is capturing.

The adapter captures them where its model config asks (``higgs_frame_graphs: true``, e.g. a deploy YAML stage's
``hf_overrides``; ``FrameGraphs.if_asked``); where it does not, the eager frame is run once per batch class its
Triton kernels compile for (``FrameGraphs.warm_eager``), so that no request's step waits for a compile. Off by
default: inside vllm-omni 0.26 on the H200 (2026-12-04) every bucket captured and the pipeline's equality tests
passed, and our host time a one-stream step fell from 3.17 to 1.21 ms, but the step stayed at 6.1 ms: under vLLM's
synchronous scheduling the worker then waits for the device instead (``benchmarks/results/h200_20261204d``). With
async scheduling too, 5.4-7.1 ms, bound by the host (``h200_20261204e``); with the adapter's launches cut, RTF 0.133
at one stream (``h200_20261204f``, our talker alone: not yet compared in one run).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from ..heads.spans import FrameFn
from .buckets import DEFAULT_BUCKETS, bucket_for, normalize_buckets
from .capture import capture_buckets, capture_checked, graph_pool
from .policy import stream_is_capturing

logger = logging.getLogger(__name__)

NO_PARAMS = (0.0, 0, 1.0)  # what a parameter given as None means (greedy, no top-k, no top-p: ``row_params``)
OPTION = "higgs_frame_graphs"  # the model config attribute that asks for them
# a batch of each class Triton compiles the frame's kernels for (``heads.fused``: an integer argument of 1, a
# multiple of 16, any other); without graphs, ``FrameGraphs.warm_eager`` runs the frame once at each
WARM_SIZES = (1, 2, 16)


class _Bucket:
    def __init__(self, size: int, hidden_size: int, dtype: torch.dtype, device: torch.device, scratch: int) -> None:
        self.size, self.scratch, self.filled = size, scratch, size  # rows [filled:] hold padding
        self.slots = torch.full((size,), scratch, dtype=torch.long, device=device)
        self.hidden = torch.zeros(size, hidden_size, dtype=dtype, device=device)
        self.tail_ids = torch.full((size,), -1, dtype=torch.long, device=device)
        self.tail_pos = torch.full((size,), -1, dtype=torch.long, device=device)
        self.temperature = torch.ones(size, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(size, dtype=torch.long, device=device)
        self.top_p = torch.ones(size, dtype=torch.float32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.results: Tensor | None = None

    def args(self) -> tuple:
        params = (self.temperature, self.top_k, self.top_p)
        return self.slots, self.hidden, self.tail_ids, self.tail_pos, params

    def write(self, step_slots, hidden, tail_ids, tail_pos, params) -> None:
        """Copy a batch of B rows in (a parameter given as None: its ``NO_PARAMS`` value); rows B.. become padding
        (only those a larger batch filled before)."""
        b = step_slots.shape[0]
        for buf, value in zip(self.args()[:4], (step_slots, hidden, tail_ids, tail_pos), strict=True):
            buf[:b].copy_(value)
        for buf, value, none in zip(self.args()[4], params, NO_PARAMS, strict=True):
            buf[:b].copy_(value[:b]) if value is not None else buf[:b].fill_(none)
        if self.filled > b:
            self.pad(b)
        self.filled = b

    def pad(self, start: int) -> None:
        """Rows ``start``.. sit in the scratch slot with a tail that opens nothing and is due nothing."""
        self.slots[start:].fill_(self.scratch)
        self.tail_ids[start:].fill_(-1)
        self.tail_pos[start:].fill_(-1)


class FrameGraphs:
    """Graphs of ``frame(slots, head, *args)`` for the batch buckets of ``buckets``, over ``slots`` (a
    ``RequestSlots``) and ``head`` (the codebook head); ``open_token`` is the tail token that opens a stream
    (``<|audio|>``), which the capture check's rows carry."""

    def __init__(self, frame: FrameFn, slots, head, buckets: Sequence[int], max_batch: int, open_token: int) -> None:
        self.frame, self.slots, self.head, self.open_token = frame, slots, head, open_token
        self.requested = normalize_buckets(buckets, max_batch)
        self.buckets: dict[int, _Bucket] = {}
        self.failed: dict[int, str] = {}
        self.replays = 0

    @classmethod
    def if_asked(cls, config, frame: FrameFn, slots, head, max_batch: int, open_token: int) -> FrameGraphs | None:
        """Captured for the decode buckets up to ``max_batch`` where ``config`` (the model's HF config) has
        ``OPTION`` true and ``head`` is on CUDA, else None (on CUDA the eager frame warmed up: ``warm_eager``);
        ValueError naming the value where ``OPTION`` is set to anything but true or false."""
        asked, weight = getattr(config, OPTION, False), head.weight
        if not isinstance(asked, bool):
            raise ValueError(f"{OPTION} must be true or false, got {asked!r}")
        if weight.device.type != "cuda":
            return None
        graphs = cls(frame, slots, head, DEFAULT_BUCKETS, max_batch, open_token)
        with torch.no_grad():  # not inference mode: its tensors could not be written outside it
            if not asked:
                graphs.warm_eager(weight.shape[1], weight.dtype, weight.device)
                return None
            graphs.capture(weight.shape[1], weight.dtype, weight.device)
        logger.info("frame graphs captured for batch buckets %s (failed: %s)", graphs.sizes, graphs.failed or "none")
        return graphs

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.buckets))

    def capture(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Capture and check every bucket, largest first; outside any stream capture."""
        self._pool_owner = graph_pool()
        store = self.slots.store

        def capture_one(size: int) -> _Bucket:
            bucket = _Bucket(size, hidden_size, dtype, device, store.scratch)
            bucket.graph, bucket.results = capture_checked(
                lambda: self.frame(self.slots, self.head, *bucket.args()), store, size, self._pool_owner.id,
                refresh=lambda: self._check_rows(bucket, self.open_token),
            )  # fmt: skip
            bucket.pad(0)
            bucket.filled = 0
            return bucket

        buckets, failed = capture_buckets(self.requested, capture_one, "frame graph")
        self.buckets |= buckets
        self.failed |= failed

    @staticmethod
    def _check_rows(bucket: _Bucket, open_token: int) -> None:
        """The rows the capture check runs on: random hidden rows, every row opening a fresh stream (its tail the
        stream's opening token) and sampling its first frame with top-k and top-p on, all in the scratch slot
        (whose state the check restores between runs)."""
        g = torch.Generator(device=bucket.hidden.device).manual_seed(bucket.size)
        noise = torch.randn(bucket.hidden.shape, generator=g, device=bucket.hidden.device)
        bucket.hidden.copy_(noise * 3)
        bucket.slots.fill_(bucket.scratch)
        bucket.tail_ids.fill_(open_token)
        bucket.tail_pos.fill_(5)
        bucket.temperature.fill_(1.0)
        bucket.top_k.fill_(50)
        bucket.top_p.fill_(0.95)

    def run(self, step_slots, hidden, tail_ids, tail_pos, params) -> Tensor | None:
        """``frame``'s results [B, C + 3] for a batch of B rows from the graph of the smallest bucket that holds
        it (a view of its static output, valid until that bucket replays again); None: run eagerly."""
        b = step_slots.shape[0]
        size = bucket_for(b, self.sizes)
        if size is None or stream_is_capturing():
            return None
        bucket = self.buckets[size]
        bucket.write(step_slots, hidden, tail_ids, tail_pos, params)
        bucket.graph.replay()
        self.replays += 1
        return bucket.results[:b]

    def warm_eager(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Without graphs: run the frame eagerly once for each batch of ``WARM_SIZES`` up to the largest bucket, on
        the capture check's rows (every row opening a stream in the scratch slot, whose state is restored), so that
        its Triton kernels are compiled and checked against their references (``heads.fused``) before a request's
        step would wait for that (the first one-request step's ``sample``: about 1.1 s in ``h200_20261204``)."""
        store, sizes = self.slots.store, [n for n in WARM_SIZES if n <= max(self.requested)]
        for size in sizes:
            rows = _Bucket(size, hidden_size, dtype, device, store.scratch)
            self._check_rows(rows, self.open_token)
            with store.preserved([store.scratch]):
                self.frame(self.slots, self.head, *rows.args())
        logger.info("eager frame warmed up for batches %s", sizes)

    def report(self) -> dict:
        """Steps replayed, buckets captured, buckets whose capture failed (why)."""
        failed = {str(k): v for k, v in self.failed.items()}
        return {"replays": self.replays, "buckets": list(self.sizes), "failed": failed}

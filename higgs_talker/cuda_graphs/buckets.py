"""Batch buckets: pure host-side arithmetic shared by the graph runners (the padding rule is ``batch.py``'s)."""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode: requests
# prefill token buckets (``prefill_buckets``' default in full_decode and auto). Eagerly a prefill step is
# host-bound (H200, 4B: 18.8 ms for 3.2 ms of kernels at 32 tokens; replayed 4.5 ms); past ~1000 tokens its
# kernels take about as long as the launches, and padding up to a next bucket would cost more than it saves.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)


def normalize_buckets(
    buckets: Sequence[int], max_batch: int | None = None, *, allow_empty: bool = False, name: str = "buckets"
) -> tuple[int, ...]:
    """Sorted, de-duplicated buckets; ``ValueError`` (naming the option ``name``) for anything but a sequence of
    integers > 0, or for an empty one unless ``allow_empty``. Buckets above ``max_batch`` are dropped, and
    ``max_batch`` itself is added so every batch the engine can form has a bucket."""
    if isinstance(buckets, str | bytes) or not isinstance(buckets, Sequence | set | frozenset):
        raise ValueError(f"{name} must be a sequence of integers > 0, got {buckets!r}")
    out = set()
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ValueError(f"{name}: every size must be an integer > 0, got {b!r}")
        out.add(b)
    if not out:
        if allow_empty:
            return ()
        raise ValueError(f"{name}: at least one size is needed, got {buckets!r}")
    if max_batch is not None:
        out = {b for b in out if b <= max_batch}
        out.add(max_batch) if not out or max(out) < max_batch else None
    return tuple(sorted(out))


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket that holds ``batch`` rows (buckets sorted ascending), or None when none does."""
    for b in buckets:
        if b >= batch:
            return b
    return None

"""Shared fixtures: the tiny checkpoint (built into a temporary cache), a loaded talker, and a checkpoint writer.

Tests marked ``@pytest.mark.gpu`` are skipped when CUDA is not available.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from higgs_talker.api import HiggsTalker
from higgs_talker.config import TalkerConfig
from higgs_talker.tiny import tiny_checkpoint, write_checkpoint


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak", type=int, default=None, metavar="N", help="requests in the engine soak test (default: the CI size)"
    )


def pytest_configure(config: pytest.Config) -> None:
    # The models under test are tiny: intra-op threads only add contention on the small CI machines.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny checkpoint, built into a session temp dir (never the user's ~/.cache)."""
    return tiny_checkpoint(cache_dir=tmp_path_factory.mktemp("tiny-cache"))


@pytest.fixture(scope="session")
def talker(tiny_dir: Path) -> HiggsTalker:
    """The tiny talker on CPU in fp32, with a modest KV cache so the suite stays light."""
    return HiggsTalker.from_pretrained(tiny_dir, max_num_seqs=8, max_model_len=1024)


@pytest.fixture
def make_checkpoint(tmp_path: Path):
    """``make_checkpoint(cfg, name=..., **kwargs)`` writes a complete checkpoint dir for ``cfg`` under tmp_path."""

    def make(cfg: TalkerConfig | None = None, name: str = "ckpt", **kwargs) -> Path:
        return write_checkpoint(tmp_path / name, cfg, **kwargs)

    return make

"""kernel_cache: where FlashInfer's, tvm-ffi's and Triton's caches are, and what a warm-up report says (no GPU
needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import higgs_talker
from higgs_talker.kernel_cache import (
    BYTECODE_VAR,
    CHOICE_CACHE_VAR,
    FLASHINFER_BASE_VAR,
    TRITON_VAR,
    TVM_FFI_VAR,
    WarmupReport,
    cache_dirs,
    cache_env,
    count_modules,
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No cache variables set, and a temporary home."""
    for var in (FLASHINFER_BASE_VAR, TVM_FFI_VAR, TRITON_VAR, CHOICE_CACHE_VAR, "TRITON_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delitem(sys.modules, "flashinfer.jit.env", raising=False)
    return tmp_path


def test_defaults_follow_flashinfer_tvm_ffi_and_triton(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_dirs() == {
        "flashinfer": clean_env / ".cache" / "flashinfer",
        "tvm_ffi": clean_env / ".cache" / "tvm-ffi",
        "triton": clean_env / ".triton" / "cache",
        "choices": clean_env / ".cache" / "higgs_talker" / "choices",
    }
    monkeypatch.setenv(CHOICE_CACHE_VAR, "off")  # no choice cache: not among the caches
    assert "choices" not in cache_dirs()
    monkeypatch.setenv("TRITON_HOME", str(clean_env / "th"))  # Triton's own home variable moves its default
    assert cache_dirs()["triton"] == clean_env / "th" / ".triton" / "cache"


def test_cache_env_puts_all_three_under_one_directory(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = clean_env / "ci-image"
    env = cache_env(base)
    assert env == {FLASHINFER_BASE_VAR: str(base), TVM_FFI_VAR: str(base / ".cache" / "tvm-ffi"),
                   TRITON_VAR: str(base / ".cache" / "triton"),
                   CHOICE_CACHE_VAR: str(base / ".cache" / "higgs_talker" / "choices"),
                   BYTECODE_VAR: str(base / ".cache" / "higgs_talker" / "bytecode")}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cache_dirs() == {"flashinfer": base / ".cache" / "flashinfer", "tvm_ffi": base / ".cache" / "tvm-ffi",
                            "triton": base / ".cache" / "triton",
                            "choices": base / ".cache" / "higgs_talker" / "choices"}  # fmt: skip


def test_count_modules(tmp_path: Path) -> None:
    assert count_modules(tmp_path / "missing") == 0
    ops = tmp_path / "90" / "cached_ops"
    for name in ("rmsnorm", "batch_decode"):
        (ops / name).mkdir(parents=True)
        (ops / name / f"{name}.so").write_bytes(b"")
        (ops / name / "build.ninja").write_text("")
    assert count_modules(tmp_path) == 2
    kernel = tmp_path / "triton" / "ABC123"  # Triton: one directory per compiled kernel, its binary a .cubin
    kernel.mkdir(parents=True)
    for name in ("_qk_norm_rope_store_kernel.cubin", "_qk_norm_rope_store_kernel.json", "__grp__x.json"):
        (kernel / name).write_text("")
    assert count_modules(tmp_path / "triton", "*.cubin") == 1


def test_cuda_report_names_the_cache_and_the_new_modules(tmp_path: Path) -> None:
    report = WarmupReport(
        checkpoint="ckpt", device="cuda:0", dtype="bfloat16", graph_mode="auto", compiled=True,
        kernels="flashinfer", load_s=90.0, graph_warmup_s=40.0, generate_s=2.0, rows=17,
        caches={"flashinfer": tmp_path / "fi", "tvm_ffi": tmp_path / "tvm", "triton": tmp_path / "tr"},
        modules_before={"flashinfer": 1, "tvm_ffi": 0, "triton": 2},
        modules_after={"flashinfer": 9, "tvm_ffi": 1, "triton": 2},
    )  # fmt: skip
    text = "\n".join(report.lines())
    assert report.total_s == 92.0
    assert "prefill + 16 decode steps" in text and "92.0 s in all" in text
    assert f"FlashInfer kernel cache: {tmp_path / 'fi'} (9 compiled modules, 8 new)" in text
    assert f"tvm-ffi cache: {tmp_path / 'tvm'} (1 compiled module, 1 new)" in text
    assert f"Triton cache: {tmp_path / 'tr'} (2 compiled modules, 0 new)" in text


def test_cuda_report_says_where_the_choices_are_kept(tmp_path: Path) -> None:
    common = dict(checkpoint="ckpt", device="cuda:0", dtype="bfloat16", graph_mode="auto", compiled=True,
                  kernels="flashinfer", load_s=9.0, rows=17)  # fmt: skip
    entry = tmp_path / "choices" / "0123abcd.json"
    report = WarmupReport(**common, caches={"choices": entry.parent}, modules_after={"choices": 3}, choices="measured",
                          choice_file=entry)  # fmt: skip
    text = "\n".join(report.lines())
    assert f"choice cache: {entry.parent} (3 entries); this start's choices measured, entry 0123abcd.json" in text
    assert CHOICE_CACHE_VAR in text  # the variable that moves it
    off = WarmupReport(**common, choices="measured")
    assert "choice cache: choices measured, kept nowhere" in "\n".join(off.lines())


def test_cuda_without_flashinfer_says_nothing_was_compiled() -> None:
    report = WarmupReport(checkpoint="ckpt", device="cuda:0", dtype="bfloat16", graph_mode="auto", compiled=False,
                          kernels="torch", load_s=3.0, rows=2)  # fmt: skip
    assert "FlashInfer is not installed" in report.lines()[-1]


def test_python_api_on_cpu(tiny_dir: Path, clean_env: Path) -> None:
    report = higgs_talker.warmup(tiny_dir, "cpu", max_model_len=256)
    assert not report.compiled and report.kernels == "torch" and report.device == "cpu"
    assert report.generate_s == 0.0 and "nothing to compile" in report.lines()[0]


def test_cuda_path_plumbing_with_a_cpu_talker(tiny_dir: Path, clean_env: Path, monkeypatch) -> None:
    """The CUDA branch of ``warmup`` (CI has no GPU): device resolution says CUDA, the load hands back a CPU
    talker, so what is checked is what the report is built from (timings, rows, caches), not the kernels."""
    import torch

    from higgs_talker import HiggsTalker, kernel_cache

    real_resolve, real_load = kernel_cache._resolve_runtime, HiggsTalker.from_pretrained
    seen = {}

    def resolve(device, dtype, graph_mode):
        _, dt, mode = real_resolve("cpu", dtype, None)
        return torch.device("cuda"), dt, mode

    def load(path, device, dtype, **kwargs):
        seen.update(kwargs, path=path, device=device)
        return real_load(path, "cpu", dtype, codec=kwargs["codec"], max_model_len=kwargs["max_model_len"])

    monkeypatch.setattr(kernel_cache, "_resolve_runtime", resolve)
    monkeypatch.setattr(HiggsTalker, "from_pretrained", staticmethod(load))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    report = kernel_cache.warmup(tiny_dir, "cuda", graph_mode="full_decode", max_model_len=256, frames=6)
    assert seen == {"path": tiny_dir, "device": torch.device("cuda"), "graph_mode": "full_decode", "codec": False,
                    "choice_cache": None, "max_model_len": 256}  # fmt: skip
    assert report.device == "cuda" and report.graph_mode == "eager"  # the CPU talker's mode
    assert not report.compiled and report.kernels == "torch"  # torch kernels: nothing of FlashInfer's ran
    assert 2 <= report.rows <= 6 + 8 and report.load_s > 0 and report.generate_s > 0
    assert report.caches == {"flashinfer": clean_env / ".cache" / "flashinfer", "tvm_ffi": clean_env / ".cache/tvm-ffi",
                             "triton": clean_env / ".triton" / "cache",
                             "choices": clean_env / ".cache" / "higgs_talker" / "choices"}  # fmt: skip
    assert report.choices == "none" and report.choice_file is None  # a CPU talker chooses nothing

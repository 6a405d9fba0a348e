"""Does programmatic dependent launch (PDL) explain the ~10 us each XQA call costs between a layer's GEMMs?

CUDA only. FlashInfer launches its kernels (XQA, norms, RoPE, SiLU-and-mul) with PDL on Hopper unless told
otherwise; cuBLAS may chain its own GEMMs the same way. For three settings (FlashInfer's default; PDL off for
every FlashInfer kernel; PDL off for XQA alone) this builds a full-decode talker (4B shape, random bf16 weights,
XQA forced, buckets 1/16/64, 512-token prompts) and prints per batch:
- the whole step and a bare replay of its graph (median ms of 20, CUDA events), and
- per layer, in CUDA graphs on the engine's own caches and tables: 36 XQA calls alone; qkv + o_proj GEMMs;
  the GEMMs with XQA between them; the GEMMs with a one-element add between them (any kernel vs XQA).

    python benchmarks/probes/pdl_step.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode import SHAPE_4B, suppress_eoc  # noqa: E402
from profile_step import layer_sandwich, start_requests  # noqa: E402
from step_kernels import median_ms  # noqa: E402

from higgs_talker import HiggsTalker, TalkerConfig, TextConfig  # noqa: E402


def set_pdl(off_modules: tuple[str, ...]) -> None:
    """Make ``device_support_pdl`` answer False in the named flashinfer modules (prefixes), True elsewhere."""
    import flashinfer.utils as fu

    for name, mod in list(sys.modules.items()):
        if name.startswith("flashinfer") and hasattr(mod, "device_support_pdl"):
            off = any(name.startswith(p) for p in off_modules)
            mod.device_support_pdl = (lambda device: False) if off else fu._original_device_support_pdl


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit(f"{Path(__file__).name} is a CUDA probe (FlashInfer, CUDA graphs): no CUDA device here")
    import flashinfer  # noqa: F401 - loads the submodules whose device_support_pdl is patched
    import flashinfer.utils as fu

    fu._original_device_support_pdl = fu.device_support_pdl
    torch.set_grad_enabled(False)
    cfg = TalkerConfig(text=TextConfig(**SHAPE_4B))
    settings = {"default": (), "off_all": ("flashinfer",), "off_xqa": ("flashinfer.decode", "flashinfer.xqa")}
    for name, off in settings.items():
        set_pdl(off)
        t0 = time.perf_counter()
        talker = HiggsTalker.from_config(
            cfg, device="cuda", dtype="bfloat16", graph_mode="full_decode", decode_kernel="xqa", buckets=[1, 16, 64],
            max_num_seqs=64, num_blocks=64 * 40 + 64, max_model_len=4096,
        )  # fmt: skip
        suppress_eoc(talker)
        eng = talker.engine
        print(f"{name}: built+warm {time.perf_counter() - t0:.1f}s", flush=True)
        for b in (1, 16, 64):
            ids = start_requests(talker, b, 512)
            step_ms, _ = median_ms(eng.step)
            replay_ms, _ = median_ms(eng.graphs.full.graphs[b].graph.replay)
            print(f"  {name} b={b}: step {step_ms:.3f} ms, replay {replay_ms:.3f} ms; {layer_sandwich(talker, b)}")
            for i in ids:
                eng.cancel(i)
                eng.requests.pop(i, None)
        del talker, eng
        torch.cuda.empty_cache()
    set_pdl(())


if __name__ == "__main__":
    main()

"""Plugin discovery and registration: entry points in the installed metadata, both registries, no vLLM on import."""

from __future__ import annotations

import pytest

# skips the module cleanly where vLLM is not installed (the core test environment)
pytest.importorskip("vllm.config")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from importlib.metadata import entry_points  # noqa: E402

from higgs_talker.vllm_plugin import ARCHITECTURES, CODEC_ARCH, CODEC_CLASS, TALKER_CLASS  # noqa: E402

MODULE, CLASS = TALKER_CLASS.split(":")
OURS = dict.fromkeys(ARCHITECTURES, TALKER_CLASS) | {CODEC_ARCH: CODEC_CLASS}  # Stage 0's and Stage 1's


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("JSON:"))
    return json.loads(line[5:])


@pytest.mark.parametrize("group", ["vllm.general_plugins", "vllm_omni.general_plugins"])
def test_entry_points_are_in_installed_metadata(group):
    eps = {e.name: e for e in entry_points(group=group)}
    assert "higgs_talker" in eps, f"higgs_talker missing from {group}: {sorted(eps)}"
    assert eps["higgs_talker"].value == "higgs_talker.vllm_plugin:register"
    assert eps["higgs_talker"].load().__module__ == "higgs_talker.vllm_plugin"


def test_fresh_process_resolves_both_registries_to_our_classes():
    """Each of our architectures (the talker's, our Stage 1's) names and loads our class in both registries."""
    code = f"""
import json, logging
from higgs_talker.vllm_plugin import register
first = register(); second = register()
from vllm.model_executor.models import ModelRegistry
from vllm_omni.model_executor.models.registry import OmniModelRegistry
out = {{"first": list(first), "second": list(second)}}
for name, reg in (("vllm", ModelRegistry), ("omni", OmniModelRegistry)):
    out[name] = {{a: [reg.models[a].module_name, reg.models[a].class_name] for a in {list(OURS)!r}}}
    out[name + "_cls"] = {{a: reg._try_load_model_cls(a).__qualname__ for a in {list(OURS)!r}}}
print("JSON:" + json.dumps(out))
"""
    out = _run(code)
    assert "vllm.ModelRegistry" in out["first"] and "vllm_omni.OmniModelRegistry" in out["first"]
    assert out["first"] == out["second"]  # idempotent
    for reg in ("vllm", "omni"):
        for arch, path in OURS.items():
            assert out[reg][arch] == path.split(":"), (reg, arch)
            assert out[reg + "_cls"][arch] == path.split(":")[1]


def test_vllm_plugin_loading_keeps_our_class_whatever_the_entry_point_order():
    """vllm-omni's own vllm.general_plugins entry re-registers its talker; ours must win in either order."""
    code = f"""
import json
from importlib.metadata import entry_points
import vllm.plugins as P
from vllm.model_executor.models import ModelRegistry
eps = list(entry_points(group="vllm.general_plugins"))
res = {{}}
for order in ("forward", "reverse"):
    for e in (eps if order == "forward" else eps[::-1]):
        if e.name in ("higgs_talker", "vllm_omni_register_models"):
            e.load()()
    res[order] = {{a: ModelRegistry.models[a].module_name for a in {list(ARCHITECTURES)!r}}}
print("JSON:" + json.dumps(res))
"""
    out = _run(code)
    for order in ("forward", "reverse"):
        assert set(out[order].values()) == {MODULE}, out


def test_omni_plugin_loader_registers_us():
    code = """
import json
from vllm_omni.plugins import load_omni_general_plugins
load_omni_general_plugins()
from vllm_omni.model_executor.models.registry import OmniModelRegistry
from vllm.model_executor.models import ModelRegistry
print("JSON:" + json.dumps({
    "omni": OmniModelRegistry.models["HiggsAudioV3TalkerForConditionalGeneration"].module_name,
    "vllm": ModelRegistry.models["HiggsMultimodalQwen3ForConditionalGeneration"].module_name,
}))
"""
    out = _run(code)
    assert out == {"omni": MODULE, "vllm": MODULE}


def test_import_higgs_talker_does_not_import_vllm():
    code = """
import json, sys
import higgs_talker, higgs_talker.vllm_plugin, higgs_talker.vllm_plugin.deploy
print("JSON:" + json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "vllm_omni"))))
"""
    assert _run(code) == []


@pytest.mark.parametrize("app_logging", [False, True], ids=["vllm-logging", "app-logging"])
def test_our_log_lines_reach_vllms_log_unless_the_application_set_up_logging(app_logging):
    """Inside vLLM (whose logger has its own handlers and does not propagate) our INFO lines, such as the adapter's
    graph decision, come out through vLLM's handlers; an application that configured the root logger keeps ours
    propagating to it, untouched."""
    setup = "logging.basicConfig(level=logging.INFO, format='ROOT %(message)s')" if app_logging else ""
    code = f"""
import json, logging
{setup}
import vllm.config  # sets up vLLM's logger
from higgs_talker.vllm_plugin import register
register()
logging.getLogger("higgs_talker.vllm_plugin.talker").info("adapter says hello")
ours = logging.getLogger("higgs_talker")
print("JSON:" + json.dumps({{"handlers": len(ours.handlers), "propagate": ours.propagate}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    said = [x for x in (out.stdout + out.stderr).splitlines() if "adapter says hello" in x]
    state = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("JSON:"))[5:])
    assert len(said) == 1, out.stdout[-2000:] + out.stderr[-2000:]
    if app_logging:
        assert said[0].startswith("ROOT ") and state == {"handlers": 0, "propagate": True}
    else:
        assert said[0].startswith("INFO "), said  # vLLM's format: level, time, [file:line], message
        assert state["handlers"] >= 1 and state["propagate"] is False

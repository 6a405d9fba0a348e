"""The package's layers (docs/architecture.md): imports point down, and nothing imports in a
circle.

Every ``import`` / ``from ... import`` inside ``higgs_talker`` is read from the source (module level and inside
functions alike; imports under ``if TYPE_CHECKING:`` are type hints only and are not counted). Each module
belongs to a layer; a module may import its own package's modules and any module of a lower layer, never one
of a higher layer, and the import graph (module level and lazy imports together) has no cycle.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "higgs_talker"

# Lower number = lower layer. A unit is a top-level module or a sub-package.
LAYERS = {
    "pdl": 0,  # below every kernel module that launches with it
    "config": 1,
    "splitting": 1,
    "bytecode": 1,
    "triton_ops": 1,
    "triton_gemv": 1,
    "triton_attention": 2,  # takes triton_ops' arguments (its check)
    "heads": 1,
    "ops": 2,
    "checkpoint": 2,
    "kv_cache": 2,
    "prompt": 2,
    "attention": 2,
    "batch": 2,
    "codec": 3,
    "model": 3,
    "flashinfer_attention": 3,
    "tiny": 4,
    "audio": 4,
    "model_runner": 4,
    "cuda_graphs": 5,
    "scheduler": 5,
    "results": 5,
    "engine": 6,
    "row_linear_op": 6,  # the row kernels as one torch op for vLLM's layers (measured with cuda_graphs.kernels)
    "driver": 7,
    "vllm_plugin": 7,
    "api": 8,
    "kernel_cache": 9,
    "serve": 9,
    "cli": 10,
    "__init__": 11,
    "__main__": 11,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"] or ["__init__"]
    return ".".join(parts)


def unit(module: str) -> str:
    return module.split(".")[0]


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path) -> set[str]:
    """Internal modules ``path`` imports at run time (relative and absolute ``higgs_talker`` imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = list(path.relative_to(ROOT).parent.parts)  # the package a relative import starts from
    skip = {id(n) for block in ast.walk(tree) if _type_checking_block(block) for n in ast.walk(block)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] if node.level > 1 else package
                prefix = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "higgs_talker":
                prefix = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:  # `from . import step` names a module; `from .x import f` names x
                candidate = ".".join([*prefix, alias.name])
                out.add(candidate if _exists(candidate) else ".".join(prefix))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "higgs_talker":
                    out.add(".".join(alias.name.split(".")[1:]))
    return {m for m in out if m and m != module_name(path)}


def _exists(module: str) -> bool:
    p = ROOT.joinpath(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


@cache
def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def test_every_unit_has_a_layer():
    units = {unit(m) for m in graph()}
    assert units <= set(LAYERS), f"modules without a layer: {sorted(units - set(LAYERS))}"


@pytest.mark.parametrize("module", sorted(graph()))
def test_imports_point_down(module):
    src = unit(module)
    for target in sorted(graph()[module]):
        dst = unit(target)
        if dst == src:
            continue
        assert LAYERS[dst] < LAYERS[src], (
            f"{module} (layer {LAYERS[src]}) imports {target} (layer {LAYERS[dst]}): imports must point down"
        )


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(g.get(m, ())):
            t = t if t in g else next((k for k in g if t.startswith(k + ".")), t)
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(t) :], t]))
            if state.get(t) is None and t in g:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(g):
        if state.get(m) is None:
            visit(m, [m])


def test_the_checker_sees_lazy_imports_and_skips_type_hints(tmp_path):
    """The reader itself: an import inside a function counts, one under TYPE_CHECKING does not."""
    mod = ROOT / "engine.py"
    found = imports_of(mod)
    assert "cuda_graphs" in found  # `from .cuda_graphs import ...` inside Engine.warm_up
    runner = imports_of(ROOT / "cuda_graphs" / "runner.py")
    assert "model_runner" not in runner and "batch" not in runner  # only under TYPE_CHECKING there

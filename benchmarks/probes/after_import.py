"""What the probes share (``step_timing/``, and the score probe of the plugin's tests in
``tests/vllm_plugin/score_probe/``): a function run on a module right after Python first imports it, and the
``sitecustomize`` chain.

A probe folder's ``sitecustomize.py`` installs its probe in every Python process started with the folder on
``PYTHONPATH`` (the processes vLLM and vllm-omni spawn inherit it), then runs the ``sitecustomize`` it hides: the
other probe's, a system one. ``install(owner, hooks)`` puts an ``AfterImport`` finder first on ``sys.meta_path``:
nothing is imported eagerly, and a process that never imports a hooked module pays one dict lookup per import.
Two probes hooking the same module both run, in the order they were installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType

_RAN: set[str] = set()  # the sitecustomize files this process has run


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds each module of ``hooks`` with the finders after it and wraps its loader, so that ``hooks[name](module)``
    runs once the module has executed."""

    def __init__(self, owner: str, hooks: Mapping[str, Callable[[ModuleType], None]]) -> None:
        self.owner, self.hooks = owner, dict(hooks)

    def find_spec(self, fullname, path, target=None):
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, hook)
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hook: Callable[[ModuleType], None]) -> None:
        self.loader, self.hook = loader, hook

    def __getattr__(self, name: str):
        return getattr(self.loader, name)  # get_source, get_code, is_package ... as the real loader has them

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.hook(module)


def install(owner: str, hooks: Mapping[str, Callable[[ModuleType], None]]) -> bool:
    """Put an ``AfterImport`` for ``hooks`` first on ``sys.meta_path``, once per ``owner``; False if it was there."""
    if any(isinstance(f, AfterImport) and f.owner == owner for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, AfterImport(owner, hooks))
    return True


def run_hidden_sitecustomize(this_file: str) -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` that this process has not run: the one ``this_file`` (a
    probe's, first on the path) hides. Each runs once, however the probes' chain finds them."""
    _RAN.add(os.path.abspath(this_file))
    rest = [p for p in sys.path if os.path.join(os.path.abspath(p or os.curdir), "sitecustomize.py") not in _RAN]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") in _RAN:
        return
    _RAN.add(os.path.abspath(spec.origin))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

"""An inert stand-in for ``torchvision``, so SGLang's host-pool modules import here.

Why it is needed: ``sglang.srt.mem_cache.pool_host`` (SGLang's ``MHATokenToKVPoolHost``
and ``MLATokenToKVPoolHost``) imports ``sglang.srt.mem_cache.memory_pool``, which imports
``sglang.srt.configs``; that package imports every model config SGLang has, and some of
them (``nano_nemotron_vl`` through ``multimodal/internvl_utils``, ``deepseek_ocr``)
import ``torchvision`` at module level, for image preprocessing. The host pools never
use it. The only ``torchvision`` wheels the package registry has are CUDA builds: with
the CPU torch they fail at import (``operator torchvision::nms does not exist``), and
once installed they also break ``transformers``' image utilities, hence SGLang's whole
import. PyTorch's CPU wheels live on its own index, which this machine cannot reach.

What it is: a meta-path finder that answers ``torchvision`` and every submodule with an
empty module whose attributes are placeholder classes. Placeholders can be looked up
(``InterpolationMode.BICUBIC`` at import time works) but refuse to be called, so code
that really needs torchvision fails loudly instead of computing with a dummy.

It is installed only after ``transformers`` has recorded torchvision as unavailable
(checked), so ``transformers`` never takes the stand-in for the real package.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__all__ = ["install"]


class _Placeholder(type):
    """A class standing for any torchvision name; every attribute is the class again."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"torchvision.{cls.__name__} was called, but torchvision is only a stand-in "
            "in these tests (see tests/workers/torchvision_stand_in.py)"
        )


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Put the stand-in on ``sys.meta_path`` (once), after transformers' check."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    import transformers.utils.import_utils as iu

    if iu.is_torchvision_available():
        raise RuntimeError(
            "a real torchvision is installed in this venv; the stand-in must not shadow it"
        )
    sys.meta_path.insert(0, _Finder())

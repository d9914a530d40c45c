"""A stand-in for ``torchvision`` (see conftest.py), installed on import: SGLang's attention
modules import it, nothing these tests run uses it. Worker processes of the shared-pool
tests import this before sglang too."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _AnyMeta(type):
    """Any attribute of a stub class is another stub class; calling one fails loudly."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyMeta(name, (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError("torchvision is a test stub in tests/sglang")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyMeta(name, (), {})


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module) -> None:
        pass


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _TorchvisionStub())

"""What SGLang's weight-update modules need on a CPU machine, imported before any `sglang` module by
tests/sglang_harness.py (the contract test's SGLang side). Nothing here touches SGLang's weight-update
code itself; it only lets its modules import without a GPU:

- `triton`, `tvm_ffi`, `torchvision`, `IPython`: GPU kernel toolchains (triton alone is 1 GB) and
  extras that SGLang imports at module level. Each name becomes a module whose attributes are classes
  (so `@triton.jit`, `tl.constexpr` annotations and `isinstance(x, triton.X)` work at import); a call
  with no argument, a query of the GPU (`driver.active.get_current_target()`), raises, so SGLang takes
  its CPU fallback.
- `torch.compile` is the identity: SGLang compiles a few kernels at import, which would pull in
  torch's inductor, which then finds the triton stub.
- CPU tensors cross processes through shared-memory files (the "file_system" strategy), as CUDA IPC
  handles do on a GPU; rollfleet's senders use the same strategy.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import torch
import torch.multiprocessing

STUBBED = {"triton", "tvm_ffi", "torchvision", "IPython"}


class _StubMeta(type):
    def __getattr__(cls, key):
        if key.startswith("__") and key.endswith("__"):
            raise AttributeError(key)
        return _stub_class(f"{cls.__name__}.{key}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # a decorator: the function stays as it is
        if not args and not kwargs:
            raise RuntimeError(f"{cls.__name__}(): GPU-only, stubbed on CPU")
        return _stub_class(f"{cls.__name__}()")

    def __getitem__(cls, key):
        return _stub_class(f"{cls.__name__}[]")

    def __iter__(cls):
        return iter(())

    def __or__(cls, other):
        return cls

    __ror__ = __or__


def _stub_class(name: str) -> type:
    return _StubMeta(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, key):
        if key.startswith("__") and key.endswith("__"):
            raise AttributeError(key)
        return _stub_class(f"{self.__name__}.{key}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__, module.__version__ = [], "0.0.0"
        return module

    def exec_module(self, module):
        pass


def _no_compile(model=None, **kwargs):
    return model if model is not None else (lambda fn: fn)


sys.meta_path.insert(0, _StubFinder())
torch.compile = _no_compile
torch.multiprocessing.set_sharing_strategy("file_system")

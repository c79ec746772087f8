"""Shared body of moe_rl's CPU stand-ins for import-only GPU packages (see sgl_kernel/, torchvision/).

SGLang's CPU engine imports `sgl_kernel` and `torchvision` (and `transformers` imports names from
`torchvision.io` / `torchvision.transforms` once it sees the package) but never calls them (measured:
shared/notes/sglang-on-cpu.md). The stand-ins are put on the SGLang server process's path only
(moe_rl.rollout.server_spec), never on the learner's. Every submodule imports and every attribute
resolves to a placeholder, so imports succeed; calling or instantiating a placeholder prints a line
to stderr and raises StandInCalled, so a CPU path that really needs the package is loud.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

MARKER = "moe_rl stand-in"  # tests grep the server log for this


class StandInCalled(RuntimeError):
    """A placeholder from a CPU stand-in package was actually used."""


def _fail(qualname: str):
    msg = (
        f"{MARKER}: {qualname} was called, but it belongs to an empty CPU stand-in (patches/stubs); "
        "the real package is GPU-only here"
    )
    print(msg, file=sys.stderr, flush=True)
    raise StandInCalled(msg)


class _PlaceholderMeta(type):
    """Placeholders are classes (so they can be hashed, subclassed, used in annotations); calling fails."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls._standin_qualname}.{name}")

    def __call__(cls, *args, **kwargs):
        _fail(cls._standin_qualname)


def placeholder(qualname: str) -> type:
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"_standin_qualname": qualname})


class StandInModule(types.ModuleType):
    """A module whose every public attribute is a placeholder."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # import machinery / introspection probes
            raise AttributeError(name)
        value = placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `<root>.<anything>` importable as a StandInModule."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install(module_globals: dict) -> None:
    """Turn the calling package `__init__` into a stand-in root; call once from each stub."""
    name = module_globals["__name__"]
    sys.modules[name].__class__ = StandInModule
    if not any(isinstance(f, _SubmoduleFinder) and f.root == name for f in sys.meta_path):
        sys.meta_path.insert(0, _SubmoduleFinder(name))

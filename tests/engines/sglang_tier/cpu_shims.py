"""Import-time stand-ins for the packages SGLang imports at module level but this CPU harness never runs.

``torchvision``: SGLang's config package imports its multimodal utilities at import time
(``sglang.srt.configs`` -> ``nano_nemotron_vl`` -> ``multimodal.internvl_utils``), which import
``torchvision.transforms``. Installing torchvision pulls a CUDA torch, so it stays out of the environment;
the stand-in is installed only when the real package is absent, and anything that *uses* it raises. Its
``__version__`` is "0.0+absent", so transformers (which checks the version) takes no torchvision path either.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any


class _Unavailable:
    """What every name of an absent package resolves to: using it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Unavailable:
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is not available in the SGLang CPU test environment")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _AbsentModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


def _install_absent(package: str, submodules: tuple[str, ...]) -> None:
    if package in sys.modules or importlib.util.find_spec(package) is not None:
        return
    for name in (package, *(f"{package}.{s}" for s in submodules)):
        module = _AbsentModule(name)
        module.__path__ = []  # a package, so its submodules import
        module.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        module.__version__ = "0.0+absent"  # transformers compares it: older than anything it would use
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def install() -> None:
    _install_absent("torchvision", ("transforms", "transforms.functional", "transforms.v2",
                                    "transforms.v2.functional", "io", "ops"))

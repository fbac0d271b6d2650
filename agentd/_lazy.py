"""Package attributes imported on first use (PEP 562).

`agentd.llm` and `agentd.platform` re-export names from modules that pull in
pydantic, httpx and numpy. An isolated agent's worker needs a few light ones (the
agent loop, the errors it catches); importing the whole package for them cost it
about 45 MiB and 0.4 s at every start. The packages list what they export
(and import it under `TYPE_CHECKING`, for type checkers); a name is imported from
its module when first read, then kept in the package's namespace.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`; `exports`: module -> its names."""
    where = {name: module for module, names in exports.items() for name in names}
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__

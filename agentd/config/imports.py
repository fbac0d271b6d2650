"""`module:attribute` references: the one place that imports what a configuration
names and the one place that changes `sys.path`.

A reference that does not resolve is a `ReferenceProblem` with a sentence for the
user, never an exception from the module's own code: a handler module that raises
on import is a configuration problem, reported with the others.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

REFERENCE = re.compile(
    r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
)
PYTHON_PATH_HINT = "is the folder that holds it listed in `python_path`?"


class ReferenceProblem(Exception):
    """A `module:attribute` reference that cannot be used; str() says why."""


def add_import_folder(folder: Path, position: int) -> int:
    """Put `folder` at `position` of `sys.path` unless it is there already; returns
    where the next folder goes (python_path's folders keep their order, first)."""
    if str(folder) in sys.path:
        return position
    sys.path.insert(position, str(folder))
    return position + 1


def resolve(ref: str) -> object:
    """The object `module:attribute` names (the attribute may be dotted)."""
    match = REFERENCE.fullmatch(ref.strip())
    if match is None:
        raise ReferenceProblem(f"expected module:attribute, got {ref!r}")
    module_name, attr = match["module"], match["attr"]
    try:
        obj: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (
            module_name == exc.name or module_name.startswith(exc.name + ".")
        ):
            raise ReferenceProblem(f"no module named {exc.name!r} ({PYTHON_PATH_HINT})") from None
        raise ReferenceProblem(f"importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # the module's own code raised: still a config problem
        raise ReferenceProblem(
            f"importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ReferenceProblem(f"{module_name!r} has no attribute {attr!r}") from None
    return obj


def resolve_handler(ref: str) -> object:
    """An `async def` function, or an instance whose `__call__` is one."""
    obj = resolve(ref)
    if not callable(obj):
        raise ReferenceProblem(f"{ref} is not callable")
    if not _is_async(obj):
        raise ReferenceProblem(f"{ref} must be an `async def` function (it is synchronous)")
    return obj


def resolve_class(ref: str, *, is_payload: object) -> type:
    """A class for which `is_payload(cls)` holds (an @xmlify dataclass)."""
    obj = resolve(ref)
    if not (inspect.isclass(obj) and callable(is_payload) and is_payload(obj)):
        raise ReferenceProblem(f"{ref} is not an @xmlify dataclass")
    return obj


def _is_async(obj: object) -> bool:
    if inspect.iscoroutinefunction(obj):
        return True
    call = getattr(obj, "__call__", None)  # noqa: B004 - an instance with async __call__
    return (
        not inspect.isroutine(obj)
        and not inspect.isclass(obj)
        and inspect.iscoroutinefunction(call)
    )

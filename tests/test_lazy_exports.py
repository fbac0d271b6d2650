"""The packages that export lazily (`agentd.durable`, `agentd.llm`, `agentd.platform`):
every name they list resolves, to the object its module defines, and nothing else
does."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType

import pytest

import agentd.durable
import agentd.llm
import agentd.platform


@pytest.mark.parametrize("package", [agentd.durable, agentd.llm, agentd.platform])
def test_every_listed_name_resolves_to_its_modules_object(package: ModuleType) -> None:
    names = package.__all__
    assert names and sorted(names) == sorted(set(names))
    for name in names:
        value = getattr(package, name)
        module = getattr(value, "__module__", None)
        if isinstance(module, str) and module.startswith(package.__name__):
            assert getattr(importlib.import_module(module), name) is value
    assert set(names) <= set(dir(package))
    with pytest.raises(AttributeError, match="no attribute 'Nonexistent'"):
        _ = package.Nonexistent


def test_star_import_and_first_use_load_only_what_is_read() -> None:
    probe = ("import sys\n"
             "from agentd.llm import LlmError\n"
             "assert 'agentd.llm._router' not in sys.modules, 'router loaded'\n"
             "from agentd.llm import *\n"
             "assert 'agentd.llm._router' in sys.modules\n")
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)

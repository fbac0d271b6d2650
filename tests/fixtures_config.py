"""Listener classes and handlers that `tests/test_config.py` names in its YAML
(`fixtures_config:Add`, ...). Imported by the configuration loader, not by the tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentd._xmlify import xmlify

NS = "https://example.org/ns/config-tests"


@xmlify(namespace=f"{NS}/calculator/add/v1")
@dataclass
class Add:
    """Adds two integers."""

    a: int
    b: int


@xmlify(namespace=f"{NS}/calculator/sum/v1")
@dataclass
class Sum:
    value: int


@xmlify(namespace=f"{NS}/hello/v1")
@dataclass
class Greeting:
    """Greets someone by name."""

    name: str


@xmlify(namespace=f"{NS}/relay/v1")
@dataclass
class Relay:
    a: int
    b: int


# Same (namespace, tag) as Greeting, but a different class.
@xmlify(namespace=f"{NS}/hello/v1", tag="greeting")
@dataclass
class OtherGreeting:
    text: str


@dataclass
class NotXml:
    x: int


class Box:
    @xmlify(namespace=f"{NS}/box/inner/v1")
    @dataclass
    class Inner:
        x: int


async def add(payload: Add, meta: Any) -> Any:
    return None


async def relay(payload: Relay, meta: Any) -> Any:
    return None


def sync_handler(payload: Add, meta: Any) -> Any:
    return None


class AsyncCallable:
    async def __call__(self, payload: Any, meta: Any) -> Any:
        return None


async_instance = AsyncCallable()
NOT_CALLABLE = 42

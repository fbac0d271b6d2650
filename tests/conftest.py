"""Test-wide settings. Under CI (CI=true), hypothesis runs derandomized: the same
examples on every run, so a submission cannot pass or fail by the luck of the draw.
Locally the search stays random, which is how new counterexamples are found.
No profile has a per-example deadline: speed is measured by benchmarks/, never
asserted by a test (a loaded 2-core machine once failed a kernel property at 252 ms
against hypothesis's default 200 ms)."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping

import pytest
import uvloop
from hypothesis import settings

from tests import postgres_cluster
from tests.daemon_process import DaemonProcess

settings.register_profile("local", deadline=None)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True,
                          deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "local")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_loops: run the test on the default asyncio loop and on uvloop")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item,
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """A test marked `both_loops` runs twice: on asyncio's own loop and on uvloop, the
    daemon's (spawning differs between them: uvloop once left descriptors open in a
    confined child). Every other test keeps the default loop."""
    if item.get_closest_marker("both_loops") is not None:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
async def daemons() -> AsyncIterator[list[DaemonProcess]]:
    """Real `agentd run` processes a test starts; any still running is killed."""
    started: list[DaemonProcess] = []
    yield started
    for d in started:
        if d.proc is not None and d.proc.returncode is None:
            await d.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A PostgreSQL server only the tests use: CI's (AGENTD_TEST_POSTGRES_DSN) or one
    started here from the installed binaries. Absent, the test skips (under CI it
    fails: CI always has one)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _unavailable("psycopg is not installed (pip install -e '.[postgres]')")
    dsn = os.environ.get(postgres_cluster.ENV_DSN)
    if dsn:
        yield dsn
        return
    try:
        with postgres_cluster.cluster() as started:
            yield started
    except (FileNotFoundError, KeyError) as exc:
        _unavailable(f"no PostgreSQL for the tests ({exc}); set "
                     f"{postgres_cluster.ENV_DSN} or install postgresql-15")


@pytest.fixture
def postgres_db(postgres_dsn: str) -> Iterator[str]:
    """The DSN of a new, empty database of its own (dropped afterwards)."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield make_conninfo(postgres_dsn, dbname=name)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> dict:
    """The kernel contract holds on both backends: the options of Kernel.open that
    choose one ({}: SQLite in the state directory; postgres: a new database)."""
    if request.param == "sqlite":
        return {}
    return {"dsn": request.getfixturevalue("postgres_db")}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI must have PostgreSQL: {reason}")
    pytest.skip(reason)

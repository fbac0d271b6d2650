"""The PostgreSQL the tests use is one they started, never the machine's own."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests import postgres_cluster


def test_the_server_is_a_throwaway_cluster_on_a_private_socket(postgres_dsn: str) -> None:
    with psycopg.connect(postgres_dsn) as conn:
        data = Path(conn.execute("SHOW data_directory").fetchone()[0])
        socket_dir = conn.execute("SHOW unix_socket_directories").fetchone()[0]
        listen = conn.execute("SHOW listen_addresses").fetchone()[0]
        version = conn.info.server_version
    host = conninfo_to_dict(postgres_dsn)["host"]
    # initdb's data folder sits in the temporary folder whose socket the DSN names.
    assert data.parent == Path(host) and socket_dir == host
    assert listen == ""  # no TCP port: nothing else on the machine can reach it
    assert version >= 150000


def test_each_test_database_is_new_and_empty(postgres_db: str) -> None:
    with psycopg.connect(postgres_db) as conn:
        tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
                              ).fetchone()[0]
        assert conninfo_to_dict(postgres_db)["dbname"].startswith("t_")
    assert tables == 0


def test_the_cluster_helper_stops_and_removes_its_server() -> None:
    if postgres_cluster.server_bin() is None:
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql-15)")
    with postgres_cluster.cluster() as dsn:
        host = Path(conninfo_to_dict(dsn)["host"])
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    assert not host.exists()
    try:
        psycopg.connect(dsn, connect_timeout=2).close()
    except psycopg.OperationalError:
        pass
    else:
        raise AssertionError("the cluster still answers after it was stopped")

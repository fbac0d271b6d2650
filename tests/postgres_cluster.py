"""A throwaway PostgreSQL cluster for the tests, from the installed server binaries.

`.ci/run` starts one and hands its DSN over in AGENTD_TEST_POSTGRES_DSN; without
that variable the `postgres_dsn` fixture starts its own (here, with `initdb` into a
temporary folder, listening on a Unix socket in that folder only), so `pytest` alone
works on a machine that has the binaries. A database the machine already runs is
never used: the only server the tests reach is one they (or CI) started.

The server refuses to run as root; as root it runs as the `postgres` user that the
Debian package creates.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ENV_DSN = "AGENTD_TEST_POSTGRES_DSN"
_DEBIAN_BINS = Path("/usr/lib/postgresql")


def server_bin() -> Path | None:
    """The folder of `initdb`, `pg_ctl` and `postgres` (version 15 or newer), or None."""
    if _DEBIAN_BINS.is_dir():
        versions = sorted((int(p.name) for p in _DEBIAN_BINS.iterdir() if p.name.isdigit()),
                          reverse=True)
        for version in versions:
            folder = _DEBIAN_BINS / str(version) / "bin"
            if version >= 15 and (folder / "initdb").exists():
                return folder
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _as_server_user() -> tuple[list[str], int | None, int | None]:
    """(command prefix, uid, gid) to run the server binaries with."""
    if os.geteuid() != 0:
        return [], None, None
    entry = pwd.getpwnam("postgres")  # KeyError: no such user (see `start`)
    return ["runuser", "-u", "postgres", "--"], entry.pw_uid, entry.pw_gid


@contextlib.contextmanager
def cluster() -> Iterator[str]:
    """Start a cluster, yield the DSN of its `postgres` database (superuser `agentd`,
    trust authentication over the socket), stop it and delete it at the end."""
    folder = server_bin()
    if folder is None:
        raise FileNotFoundError("no PostgreSQL 15+ server binaries (apt-get install "
                                "postgresql-15)")
    prefix, uid, gid = _as_server_user()
    root = Path(tempfile.mkdtemp(prefix="agentd-pg-"))
    try:
        if uid is not None:
            os.chown(root, uid, gid if gid is not None else -1)
        data = root / "data"
        subprocess.run([*prefix, str(folder / "initdb"), "-D", str(data), "-U", "agentd",
                        "-A", "trust", "-E", "UTF8", "--no-sync", "--no-instructions"],
                       check=True, capture_output=True)
        options = f"-k {root} -c listen_addresses='' -c fsync=off -c max_connections=200"
        subprocess.run([*prefix, str(folder / "pg_ctl"), "-D", str(data), "-l",
                        str(root / "log"), "-w", "-o", options, "start"],
                       check=True, capture_output=True)
        try:
            yield f"postgresql://agentd@/postgres?host={root}"
        finally:
            subprocess.run([*prefix, str(folder / "pg_ctl"), "-D", str(data), "-m",
                            "immediate", "-w", "stop"], capture_output=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

"""A pids cgroup per confined child: where it is made, the bound it puts on a fork
bomb (real forks in a real worker), the kill and removal, what a daemon killed with
SIGKILL left, and the loud degradation where no pids cgroup can be made.

The attacks need a pids cgroup this process may make children in (root on a cgroup
v1 `pids` hierarchy, or a delegated v2 subtree); they are skipped, with the reason
`Cgroups.discover()` gives, elsewhere."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentd.config import load_config
from agentd.confine import Policy, _cgroup, _spawn, cgroups, kill_group, spawn
from agentd.confine._cgroup import PREFIX, Cgroups, Hierarchy, TaskGroup, locate, prepare
from agentd.isolation._plan import worker_policy
from agentd.testing import Harness
from tests.isolated.watch import gone
from tests.test_isolation import CLIENTS, ask, needs_landlock, organism, settled

FOUND = Cgroups.discover()
needs_pids_cgroup = pytest.mark.skipif(
    not FOUND.available, reason=f"no pids cgroup to make children in: {FOUND.reason}")



def group_of(pid: int) -> TaskGroup | None:
    """The agentd cgroup the kernel lists a live `pid` in (/proc/PID/cgroup), if any."""
    if FOUND.hierarchy is None:
        return None
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        for part in line.partition(":")[2].partition(":")[2].split("/"):
            if part.startswith(PREFIX):
                return TaskGroup(FOUND.hierarchy.base / part)
    return None


HYBRID = """\
9:name=systemd:/
8:pids:/system.slice/agentd.service
4:memory:/process_api/5e88
0::/system.slice/agentd.service
"""
HYBRID_MOUNTS = """\
30 22 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
34 30 0:30 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
40 30 0:36 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
41 30 0:37 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
"""
UNIFIED = "0::/system.slice/agentd.service/daemon\n"
UNIFIED_MOUNTS = "35 24 0:30 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"


def test_a_v1_pids_hierarchy_is_preferred_on_a_hybrid_system() -> None:
    assert locate(HYBRID, HYBRID_MOUNTS) == (
        Hierarchy(1, Path("/sys/fs/cgroup/pids/system.slice/agentd.service")), "")


def test_the_unified_hierarchy_is_used_alone() -> None:
    assert locate(UNIFIED, UNIFIED_MOUNTS) == (
        Hierarchy(2, Path("/sys/fs/cgroup/system.slice/agentd.service/daemon")), "")


def test_a_container_sees_its_cgroup_below_the_mounts_root() -> None:
    """Mount root /docker/abc shows /docker/abc/x at <mount>/x; a path outside the
    mount's root is not visible, and mount paths with spaces are unescaped."""
    mounts = "40 30 0:36 /docker/abc /sys/fs/cgroup/my\\040pids rw - cgroup cgroup rw,pids\n"
    assert locate("8:pids:/docker/abc/x\n", mounts) == (
        Hierarchy(1, Path("/sys/fs/cgroup/my pids/x")), "")
    found, why = locate("8:pids:/elsewhere\n", mounts)
    assert found is None and "no pids cgroup hierarchy" in why


def test_no_cgroup_at_all_says_so() -> None:
    assert locate("", HYBRID_MOUNTS) == (
        None, "the daemon is in no cgroup (no /proc/self/cgroup entry)")
    found, why = locate("1:cpu:/\n", "")
    assert found is None and why


def test_v2_needs_the_controller_delegated(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    found, why = prepare(Hierarchy(2, tmp_path))
    assert found is None and "pids controller is not delegated" in why


def test_v2_uses_a_parent_that_already_enables_pids_for_its_children(tmp_path: Path) -> None:
    """systemd's DelegateSubgroup: the daemon in <service>/daemon, pids enabled in the
    service's cgroup for its children: they are made beside the daemon's."""
    daemon = tmp_path / "daemon"
    daemon.mkdir()
    (daemon / "cgroup.controllers").write_text("pids\n")
    (daemon / "cgroup.subtree_control").write_text("\n")
    (tmp_path / "cgroup.subtree_control").write_text("pids\n")
    assert prepare(Hierarchy(2, daemon)) == (Hierarchy(2, tmp_path), "")
    other = tmp_path / "agentd.service"  # not the daemon's sub-cgroup: never its parent
    other.mkdir()
    (other / "cgroup.controllers").write_text("pids\n")
    (other / "cgroup.subtree_control").write_text("")
    assert prepare(Hierarchy(2, other)) == (Hierarchy(2, other), "")


def test_v2_enables_pids_for_its_children_where_it_may(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    assert prepare(Hierarchy(2, tmp_path)) == (Hierarchy(2, tmp_path), "")
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+pids"


def test_a_v1_directory_that_is_no_cgroup_is_refused(tmp_path: Path) -> None:
    found, why = prepare(Hierarchy(1, tmp_path))
    assert found is None and "is not a cgroup" in why


# ---- real cgroups --------------------------------------------------------------

FORKER = """
import os, sys, time
made = 0
for _ in range(int(sys.argv[1])):
    try:
        pid = os.fork()
    except OSError as exc:
        print(f"failed errno={exc.errno} after={made}", flush=True)
        break
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    made += 1
else:
    print(f"forked {made}", flush=True)
time.sleep(600)
"""


def python_policy(max_tasks: int | None) -> Policy:
    reads = (*Policy().read_paths, sys.base_prefix, sys.prefix,
             os.path.dirname(os.path.realpath(sys.executable)))
    return Policy(max_tasks=max_tasks, read_paths=reads, network=True)


@needs_pids_cgroup
async def test_a_fork_bomb_stops_at_max_tasks_and_all_of_it_is_killed() -> None:
    proc = await spawn([sys.executable, "-I", "-S", "-c", FORKER, "500"], python_policy(12))
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    assert line.startswith("failed errno=11 after=11"), line  # EAGAIN: 12 tasks in all
    group = group_of(proc.pid)
    assert group is not None
    pids = group.pids()
    assert len(pids) == 12 and proc.pid in pids
    assert await kill_group(proc) == -9
    assert not group.path.exists()
    for pid in pids:
        assert await gone(pid)


@needs_pids_cgroup
async def test_a_process_that_left_the_group_is_still_killed() -> None:
    """Where nothing keeps a child in its process group (no seccomp filter on this
    architecture), the cgroup still lists it: killed with the rest."""
    leaver = ("import os, time\n"
              "if os.fork() == 0:\n"
              "    os.setpgid(0, 0)\n"  # refused by the filter where there is one
              "    time.sleep(600)\n"
              "print('ok', flush=True)\n"
              "time.sleep(600)\n")
    proc = await spawn([sys.executable, "-I", "-S", "-c", leaver], python_policy(8))
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 30)) == b"ok\n"
    group = group_of(proc.pid)
    assert group is not None
    pids = group.pids()
    assert len(pids) == 2
    await kill_group(proc)
    for pid in pids:
        assert await gone(pid)
    assert not group.path.exists()


@needs_pids_cgroup
async def test_a_cgroup_made_beneath_the_childs_is_killed_and_removed_with_it() -> None:
    """A child without Landlock could make a cgroup inside its own and move a process
    there: it is killed and removed with the rest."""
    proc = await spawn([sys.executable, "-I", "-S", "-c", FORKER, "1"], python_policy(8))
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 30)) == b"forked 1\n"
    group = group_of(proc.pid)
    assert group is not None
    [grandchild] = [pid for pid in group.pids() if pid != proc.pid]
    (group.path / "inner").mkdir()
    (group.path / "inner" / "cgroup.procs").write_text(str(grandchild))
    assert group.pids().count(grandchild) == 1
    await kill_group(proc)
    assert await gone(grandchild)
    assert not group.path.exists()


def test_without_landlock_only_another_uid_is_kept_from_its_cgroup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cgroup's files are the daemon's, mode 0644: a child of the same uid could
    raise its own pids.max where no Landlock rule keeps it out. Then the bound is not
    counted as enforced, unless the child runs as another user."""
    from agentd.confine._policy import LandlockStatus

    monkeypatch.setattr(_spawn, "landlock_status", lambda: LandlockStatus(
        abi=0, filesystem=False, network_tcp=False, scopes=False,
        network_namespace=True, seccomp=True))
    monkeypatch.setattr(_cgroup, "_cgroups", Cgroups(Hierarchy(1, Path("/nowhere"))))
    assert not _spawn.tasks_limited(python_policy(4))
    other = 65534 if os.geteuid() != 65534 else 65533
    assert _spawn.tasks_limited(Policy(max_tasks=4, uid=other, gid=other))


@needs_pids_cgroup
async def test_cgroups_left_by_a_daemon_killed_with_sigkill_are_removed() -> None:
    """A cgroup named for a daemon that is gone, with a process still in a cgroup
    beneath it: the next daemon kills the process and removes both; one named for
    this pid with another start time (a reused pid) goes too; its own are kept."""
    hierarchy = FOUND.hierarchy
    assert hierarchy is not None
    code = ("import os; from agentd.confine._cgroup import start_time; "
            "print(f'{os.getpid()}.{start_time(\"self\")}')")
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).parent.parent)
    stale = hierarchy.base / f"agentd-{dead.stdout.strip()}-1"
    reused = hierarchy.base / f"agentd-{os.getpid()}.1-1"
    (stale / "nested").mkdir(parents=True)
    reused.mkdir()
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        (stale / "nested" / "cgroup.procs").write_text(str(sleeper.pid))
        assert Cgroups(hierarchy).sweep() >= 2  # (and any an earlier run left)
        assert sleeper.wait(10) == -9
        assert not stale.exists() and not reused.exists()
        mine = cgroups().make(4)
        try:
            assert Cgroups(hierarchy).sweep() == 0
            assert mine.path.exists()
        finally:
            mine.remove()
    finally:
        sleeper.kill()
        sleeper.wait()
        for path in (stale, reused):
            if path.exists():
                TaskGroup(path).kill()
                TaskGroup(path).remove()


@needs_pids_cgroup
async def test_a_fork_bomb_in_an_isolated_handler_is_bounded_and_its_worker_replaced(
        tmp_path: Path) -> None:
    config = load_config(organism(tmp_path, "{memory_mb: 1024, workers: 1, max_tasks: 16}",
                                  timeout_s=30))
    (tmp_path / "state").mkdir()
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        pool = h.isolation.pools["prober"]
        assert pool.status()["tasks_limited"] == 1
        assert h.isolation.status()["confinement"]["pids_cgroup"].startswith(
            f"cgroup v{FOUND.hierarchy.version} pids at ")  # type: ignore[union-attr]
        groups = [group_of(w.pid) for w in pool.workers]  # one serves, a spare
        assert None not in groups and len({g.path for g in groups if g}) == 2
        kind, text = await ask(h, "fork-bomb", "2000")
        assert kind == "outcome"
        forked, errno = (int(part.split("=")[1]) for part in text.split())
        assert errno == 11  # EAGAIN
        assert forked < 16  # the worker's own threads count too
        await settled(h, 1)  # the children it left: the worker is replaced
        assert sorted(g.path.exists() for g in groups if g) == [False, True]
        assert await ask(h, "echo", "still here") == ("outcome", "still here")


@needs_pids_cgroup
@needs_landlock
async def test_a_worker_cannot_move_itself_out_of_its_cgroup(tmp_path: Path) -> None:
    hierarchy = FOUND.hierarchy
    assert hierarchy is not None
    config = load_config(organism(tmp_path, "{memory_mb: 1024, workers: 1}", timeout_s=30))
    (tmp_path / "state").mkdir()
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        kind, text = await ask(h, "leave-cgroup", str(hierarchy.base / "cgroup.procs"))
        assert (kind, text) == ("outcome", "refused errno=13")
        for worker in h.isolation.pools["prober"].workers:
            assert group_of(worker.pid) is not None


async def test_without_a_pids_cgroup_children_run_unbounded_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A kernel or service without a pids cgroup to use: the child runs (its other
    limits apply), a warning says once what is missing, status says why."""
    monkeypatch.setattr(_cgroup, "_cgroups", Cgroups(None, "no pids controller (test)"))
    monkeypatch.setattr(_spawn, "_warned_tasks", False)
    caplog.set_level(logging.WARNING, "agentd.confine")
    for _ in range(2):
        proc = await spawn([sys.executable, "-I", "-S", "-c",
                            "import time; print(1, flush=True); time.sleep(60)"],
                           python_policy(4))
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)) == b"1\n"
        assert group_of(proc.pid) is None  # running, in no cgroup of its own
        assert await kill_group(proc) in (0, -9)
    warnings = [r.message for r in caplog.records if "no pids cgroup" in r.message]
    assert warnings == ["confine: no pids cgroup (no pids controller (test)); the processes "
                        "a confined child starts are bounded only by its timeout and the "
                        "service's TasksMax"]
    assert cgroups().describe() == "unavailable: no pids controller (test)"
    assert not _spawn.tasks_limited(python_policy(4))


def test_max_tasks_reaches_each_kind_of_confined_child(tmp_path: Path) -> None:
    """isolation.max_tasks (default 64) and an exec tool's max_tasks (default 64) end
    up in the policies their children are spawned with."""
    from agentd.config.tools import ExecTool
    from agentd.isolation._plan import effective_isolation
    from agentd.tools.exec import policy_for

    config = load_config(organism(tmp_path, "{max_tasks: 9}"))
    isolation = effective_isolation(config)
    assert isolation["prober"].max_tasks == 9
    assert isolation["relay"].max_tasks == 64
    [lst] = [x for x in config.listeners if x.name == "prober"]
    assert worker_policy(lst, isolation["prober"], (), ()).max_tasks == 9
    assert policy_for(ExecTool(kind="exec", argv=("/bin/true",)), "/bin/true").max_tasks == 64
    assert policy_for(ExecTool(kind="exec", argv=("/bin/true",), max_tasks=3),
                      "/bin/true").max_tasks == 3


@needs_pids_cgroup
async def test_a_daemon_exiting_without_killing_its_children_kills_their_cgroups(
        tmp_path: Path) -> None:
    """A confined child still running when the daemon's interpreter exits (an MCP
    server, say) goes with everything in its cgroup, and the empty cgroup is removed."""
    script = tmp_path / "leave.py"
    script.write_text(
        "import asyncio, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent.parent)!r})\n"
        "from agentd.confine import _spawn\n"
        "from tests.test_cgroup import FORKER, group_of, python_policy\n"
        "async def main():\n"
        "    proc = await _spawn.spawn([sys.executable, '-I', '-S', '-c', FORKER, '2'],\n"
        "                              python_policy(8))\n"
        "    await proc.stdout.readline()\n"
        "    group = group_of(proc.pid)\n"
        "    print(group.path, *group.pids(), flush=True)\n"
        "asyncio.run(main())\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parent.parent, check=True)
    path, *pids = done.stdout.split()
    assert len(pids) == 3
    for pid in pids:
        assert await gone(int(pid))
    for _ in range(100):
        if not Path(path).exists():
            break
        await asyncio.sleep(0.05)
    else:  # removed by the next start's sweep, at the latest
        assert Cgroups(FOUND.hierarchy).sweep() == 1  # type: ignore[arg-type]

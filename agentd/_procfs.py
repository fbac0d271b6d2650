"""What `/proc/PID/stat` says of a process. Standard library only."""

from __future__ import annotations


def stat_fields(pid: int | str) -> list[bytes]:
    """The fields of `/proc/PID/stat` after the command name, which may hold spaces and
    parentheses itself: index 0 is the state (field 3 in proc(5)), index 11 and 12
    utime and stime, index 19 the start time. Raises OSError."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()

"""The file tools attacked: every way out of the root is refused, by openat2 and by
the O_NOFOLLOW walk alike, and writes are atomic."""

from __future__ import annotations

import ctypes
import os
import posixpath
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentd.tools import Denied
from agentd.tools.beneath import OPENAT2, Root, relative_parts
from agentd.tools.files import (
    DirLister,
    Encoding,
    EntryKind,
    FileReader,
    FileWriter,
    ListDir,
    ReadFile,
    WriteFile,
    WriteMode,
)

MECHANISMS = [pytest.param(True, id="openat2"), pytest.param(False, id="walk")]


@pytest.fixture(params=MECHANISMS)
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Root]:
    if request.param and not OPENAT2:
        pytest.skip("this kernel has no openat2")
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("SECRET")
    (tmp_path / "root" / "hello.txt").write_text("hello")
    (tmp_path / "root" / "sub").mkdir()
    (tmp_path / "root" / "sub" / "inner.txt").write_text("inner")
    yield Root(tmp_path / "root", use_openat2=request.param)


def read(root: Root, path: str, **kw: int) -> str:
    content = FileReader(root, 1 << 20).read(ReadFile(path=path, **kw))
    assert content is not None
    return content.data


def refused(call: object, *args: object) -> str:
    with pytest.raises(Denied) as info:
        call(*args)  # type: ignore[operator]
    return info.value.cause


# --- the path as text --------------------------------------------------------------


@pytest.mark.parametrize(("path", "parts"), [
    ("", ()), (".", ()), ("a/b", ("a", "b")), ("a//./b/", ("a", "b")),
    ("a/../b", ("b",)), ("a/b/../../c", ("c",)),
])
def test_paths_inside_the_root_are_normalised(path: str, parts: tuple[str, ...]) -> None:
    assert relative_parts(path) == parts


@pytest.mark.parametrize(("path", "cause"), [
    ("..", "path escapes the root"),
    ("../outside/secret", "path escapes the root"),
    ("sub/../../outside/secret", "path escapes the root"),
    ("/etc/passwd", "absolute path"),
    ("/proc/self/root/etc/passwd", "absolute path"),
    ("hello.txt\x00.png", "NUL byte in path"),
    ("a" * 4096, "path too long"),
    ("a" * 256, "name too long"),
    ("/".join(["abcdefgh"] * 512), "path too long"),
])
def test_paths_that_cannot_be_inside_are_refused_before_the_disk(path: str, cause: str) -> None:
    assert refused(relative_parts, path) == cause


@given(st.lists(st.sampled_from(["a", "b", ".", "..", "", "/", "c d", "\x00"]),
                max_size=12).map("/".join))
def test_any_path_is_refused_or_names_only_plain_components_below_the_root(
    path: str,
) -> None:
    try:
        parts = relative_parts(path)
    except Denied:
        return
    assert all(p not in ("", ".", "..") and "/" not in p and "\x00" not in p for p in parts)
    # The place POSIX normalisation gives (no symlinks are followed, so `..` is
    # lexical), and never above the root.
    assert ("/".join(parts) or ".") == posixpath.normpath(path)


# --- reading -----------------------------------------------------------------------


def test_a_file_inside_is_read(root: Root) -> None:
    assert read(root, "hello.txt") == "hello"
    assert read(root, "sub/../sub/inner.txt") == "inner"
    assert read(root, "hello.txt", offset=1, length=3) == "ell"


def test_binary_content_comes_back_as_base64(root: Root) -> None:
    (root.path / "bin").write_bytes(b"\x00\xff")
    content = FileReader(root, 100).read(ReadFile(path="bin"))
    assert content is not None and content.encoding is Encoding.BASE64
    assert content.data == "AP8="


def test_reads_stop_at_max_bytes_and_tell_the_whole_size(root: Root) -> None:
    (root.path / "big").write_bytes(b"x" * 1000)
    content = FileReader(root, 100).read(ReadFile(path="big"))
    assert content is not None and len(content.data) == 100 and content.size == 1000


def test_dot_dot_out_of_the_root_is_refused(root: Root) -> None:
    assert refused(read, root, "../outside/secret") == "path escapes the root"


def test_absolute_path_is_refused_not_reinterpreted(root: Root) -> None:
    (root.path / "etc").mkdir()
    (root.path / "etc" / "passwd").write_text("inside")
    assert refused(read, root, "/etc/passwd") == "absolute path"


def test_symlink_to_a_file_outside_is_refused(root: Root) -> None:
    (root.path / "link").symlink_to(root.path.parent / "outside" / "secret")
    assert refused(read, root, "link") == "symbolic link in path"


def test_symlink_to_a_directory_outside_is_refused(root: Root) -> None:
    (root.path / "dir").symlink_to(root.path.parent / "outside")
    assert refused(read, root, "dir/secret") == "symbolic link in path"


def test_relative_symlink_climbing_out_is_refused(root: Root) -> None:
    (root.path / "sub" / "up").symlink_to("../../outside")
    assert refused(read, root, "sub/up/secret") == "symbolic link in path"


def test_proc_self_root_magic_link_is_refused(root: Root) -> None:
    (root.path / "proc").symlink_to("/proc/self/root")
    assert refused(read, root, "proc/etc/hostname") == "symbolic link in path"


def test_fifo_is_refused_without_blocking(root: Root) -> None:
    os.mkfifo(root.path / "pipe")
    assert refused(read, root, "pipe").startswith("not a regular file")


def test_device_is_refused(root: Root) -> None:
    try:
        os.mknod(root.path / "zero", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("cannot create a device node here")
    assert refused(read, root, "zero").startswith("not a regular file")


def test_directory_is_not_read_as_a_file(root: Root) -> None:
    assert refused(read, root, "sub").startswith("not a regular file")


def test_a_missing_file_is_none_not_a_denial(root: Root) -> None:
    assert FileReader(root, 10).read(ReadFile(path="nope")) is None


def _exchange(libc: ctypes.CDLL, a: bytes, b: bytes) -> None:
    if libc.renameat2(-100, a, -100, b, 2) != 0:  # RENAME_EXCHANGE
        raise OSError(ctypes.get_errno(), "renameat2")


def test_symlink_swapped_in_during_the_calls_never_leads_outside(root: Root) -> None:
    """A thread atomically exchanges a real directory and a symlink to outside
    (renameat2 RENAME_EXCHANGE) as fast as it can while reads run: every read gets
    the inside file, a refusal or "not found", never the outside one."""
    libc = ctypes.CDLL(None, use_errno=True)
    (root.path / "d").mkdir()
    (root.path / "d" / "secret").write_text("inside")
    (root.path / "x").symlink_to(root.path.parent / "outside")
    a, b = bytes(root.path / "d"), bytes(root.path / "x")
    stop = threading.Event()
    swaps = 0

    def swap() -> None:
        nonlocal swaps
        while not stop.is_set():
            _exchange(libc, a, b)
            swaps += 1

    reader = FileReader(root, 100)
    seen: set[str] = set()
    flipper = threading.Thread(target=swap)
    flipper.start()
    try:
        for _ in range(3000):
            try:
                content = reader.read(ReadFile(path="d/secret"))
            except Denied as exc:
                seen.add(exc.cause)
            else:
                seen.add("missing" if content is None else content.data)
    finally:
        stop.set()
        flipper.join()
    assert swaps > 100
    assert "SECRET" not in seen
    assert "inside" in seen and "symbolic link in path" in seen


# --- writing -----------------------------------------------------------------------


def write(root: Root, path: str, data: str, mode: WriteMode | None = None,
          max_bytes: int = 1 << 20) -> int:
    written = FileWriter(root, max_bytes).write(WriteFile(path=path, data=data, mode=mode))
    assert written is not None
    return written.size


def test_create_overwrite_append(root: Root) -> None:
    assert write(root, "new.txt", "one") == 3
    assert (root.path / "new.txt").read_text() == "one"
    assert write(root, "new.txt", "two", WriteMode.OVERWRITE) == 3
    assert write(root, "new.txt", "+3", WriteMode.APPEND) == 5
    assert (root.path / "new.txt").read_text() == "two+3"
    assert sorted(p.name for p in root.path.iterdir()) == ["hello.txt", "new.txt", "sub"]


def test_create_does_not_replace(root: Root) -> None:
    from agentd.tools.files import Exists

    with pytest.raises(Exists):
        write(root, "hello.txt", "x")
    assert (root.path / "hello.txt").read_text() == "hello"


def test_base64_data_is_written_as_bytes(root: Root) -> None:
    writer = FileWriter(root, 100)
    writer.write(WriteFile(path="b", data="AP8=", encoding=Encoding.BASE64))
    assert (root.path / "b").read_bytes() == b"\x00\xff"


def test_write_through_a_symlinked_directory_is_refused(root: Root) -> None:
    (root.path / "out").symlink_to(root.path.parent / "outside")
    assert refused(write, root, "out/secret", "pwned", WriteMode.OVERWRITE) == \
        "symbolic link in path"
    assert (root.path.parent / "outside" / "secret").read_text() == "SECRET"


def test_overwriting_a_symlink_to_outside_is_refused(root: Root) -> None:
    (root.path / "link").symlink_to(root.path.parent / "outside" / "secret")
    assert refused(write, root, "link", "pwned", WriteMode.OVERWRITE) == \
        "symbolic link in path"
    assert (root.path.parent / "outside" / "secret").read_text() == "SECRET"


@pytest.mark.parametrize("mode", [WriteMode.OVERWRITE, WriteMode.APPEND])
def test_hard_link_to_a_file_outside_is_not_written(root: Root, mode: WriteMode) -> None:
    os.link(root.path.parent / "outside" / "secret", root.path / "hard")
    assert refused(write, root, "hard", "pwned", mode) == "file has other hard links"
    assert (root.path.parent / "outside" / "secret").read_text() == "SECRET"


@pytest.mark.parametrize("mode", [WriteMode.OVERWRITE, WriteMode.APPEND])
def test_a_rewritten_file_keeps_its_permissions_but_not_setuid(root: Root,
                                                               mode: WriteMode) -> None:
    target = root.path / "tool.sh"
    target.write_text("#!/bin/sh\necho original\n")
    os.chmod(target, 0o6755)
    write(root, "tool.sh", "echo caller\n", mode)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755
    assert target.read_text().endswith("echo caller\n")


def test_writing_onto_a_fifo_is_refused(root: Root) -> None:
    os.mkfifo(root.path / "pipe")
    assert refused(write, root, "pipe", "x", WriteMode.OVERWRITE).startswith(
        "not a regular file")


def test_data_over_max_bytes_is_refused(root: Root) -> None:
    assert refused(write, root, "big", "x" * 11, None, 10) == "data larger than max_bytes"
    write(root, "grow", "x" * 6, None, 10)
    assert refused(write, root, "grow", "y" * 6, WriteMode.APPEND, 10) == \
        "file would grow past max_bytes"


def test_dot_dot_and_absolute_writes_are_refused(root: Root) -> None:
    assert refused(write, root, "../outside/new", "x") == "path escapes the root"
    assert refused(write, root, "/tmp/new", "x") == "absolute path"
    assert not (root.path.parent / "outside" / "new").exists()


def test_temporary_names_cannot_be_written(root: Root) -> None:
    assert refused(write, root, ".agentd-tmp-0123", "x") == \
        "name reserved for temporary files"


def test_a_reader_never_sees_half_a_file(root: Root) -> None:
    """Overwrites of 1 MiB files alternate while a thread reads: every read is one
    whole version."""
    versions = ["a" * (1 << 20), "b" * (1 << 20)]
    write(root, "big", versions[0])
    stop = threading.Event()
    seen: set[str] = set()

    def watch() -> None:
        while not stop.is_set():
            data = (root.path / "big").read_text()
            seen.add(data[:1] + str(len(set(data))) + str(len(data)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(20):
            write(root, "big", versions[i % 2], WriteMode.OVERWRITE)
    finally:
        stop.set()
        watcher.join()
    assert seen <= {f"a1{1 << 20}", f"b1{1 << 20}"}
    assert not [p for p in root.path.iterdir() if p.name.startswith(".agentd-tmp-")]


# --- listing -----------------------------------------------------------------------


def test_listing_names_kinds_and_sizes(root: Root) -> None:
    (root.path / "link").symlink_to("hello.txt")
    os.mkfifo(root.path / "pipe")
    listing = DirLister(root, 100).list(ListDir(path=""))
    assert listing is not None
    assert [(e.name, e.kind, e.size) for e in listing.entry] == [
        ("hello.txt", EntryKind.FILE, 5), ("link", EntryKind.OTHER, 0),
        ("pipe", EntryKind.OTHER, 0), ("sub", EntryKind.DIR, 0)]


def test_listing_stops_at_max_entries(root: Root) -> None:
    for i in range(10):
        (root.path / f"f{i}").touch()
    listing = DirLister(root, 4).list(ListDir(path="."))
    assert listing is not None and len(listing.entry) == 4


def test_listing_outside_is_refused(root: Root) -> None:
    (root.path / "out").symlink_to(root.path.parent / "outside")
    lister = DirLister(root, 10)
    assert refused(lister.list, ListDir(path="out")) == "symbolic link in path"
    assert refused(lister.list, ListDir(path="..")) == "path escapes the root"
    assert refused(lister.list, ListDir(path="/")) == "absolute path"


def test_a_file_used_as_a_folder_is_not_found(root: Root) -> None:
    assert FileReader(root, 10).read(ReadFile(path="hello.txt/x")) is None

"""The file tools: `file-read`, `file-write` and `file-list`, confined to a root.

Every path is resolved beneath the root by the kernel (`agentd.tools.beneath`); a
request that would leave it, or that names a symbolic link, is a `Denied` (the
caller gets `huh denied`, the journal the cause). Only regular files are read or
replaced: a FIFO or device is opened non-blocking and refused after `fstat`, never
read. Writes are atomic: a temporary file in the target's directory, written,
fsynced, then renamed (or linked, for `create`, which must not replace) over the
name relative to the directory's descriptor, and the directory fsynced; a reader
sees the old file or the new one, never half of one. A name with several hard links
is never replaced or appended to (the other names may be outside the root).

Blocking file I/O runs in a worker thread so a slow disk stalls the call, not the
pump. What a missing file or an existing one (for `create`) gets is an ordinary
`huh invalid-payload` with a short reason: not a confinement matter.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import errno
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any

from agentd._errors import Denied
from agentd._handler import HandlerMetadata, HandlerResponse
from agentd._xmlify import ILLEGAL_XML_CHAR, MaxLen, xmlify
from agentd.tools.beneath import PATH_MAX, Root, relative_parts, shown
from agentd.tools.content import Encoding, as_xml_text
from agentd.tools.kinds import Handler, LoadedTool

NS = "https://xml-pipeline.org/ns/tools"
# Schema bounds only; the configured `max_bytes` is what a call may use.
_PATH_CHARS = 2 * PATH_MAX  # longer than any path the kernel takes, so the tool refuses it
_DATA_CHARS = 64 * 1024 * 1024
_TEMP_PREFIX = ".agentd-tmp-"


class WriteMode(Enum):
    CREATE = "create"
    OVERWRITE = "overwrite"
    APPEND = "append"


class EntryKind(Enum):
    FILE = "file"
    DIR = "dir"
    OTHER = "other"


Path_ = Annotated[str, MaxLen(_PATH_CHARS), "a path relative to the tool's folder"]


@xmlify(namespace=f"{NS}/file-read/v1", tag="read-file")
@dataclass
class ReadFile:
    """Reads a file in the tool's folder (at most its configured size per call)."""

    path: Path_
    offset: Annotated[int, "the first byte to read (default 0)"] | None = None
    length: Annotated[int, "how many bytes to read at most"] | None = None


@xmlify(namespace=f"{NS}/file-read/v1", tag="file-content")
@dataclass
class FileContent:
    """A file's content, or the part of it that was asked for."""

    path: Path_
    size: Annotated[int, "the whole file's size in bytes"]
    encoding: Annotated[Encoding, "utf-8 for text, base64 for anything else"]
    data: Annotated[str, MaxLen(_DATA_CHARS)]


@xmlify(namespace=f"{NS}/file-write/v1", tag="write-file")
@dataclass
class WriteFile:
    """Writes a file in the tool's folder, atomically."""

    path: Path_
    data: Annotated[str, MaxLen(_DATA_CHARS)]
    encoding: Annotated[Encoding, "how data is given (default utf-8)"] | None = None
    mode: Annotated[WriteMode, "create (default: the file must not exist), "
                    "overwrite or append"] | None = None


@xmlify(namespace=f"{NS}/file-write/v1", tag="file-written")
@dataclass
class FileWritten:
    """The file was written; its size now."""

    path: Path_
    size: int


@xmlify(namespace=f"{NS}/file-list/v1", tag="list-dir")
@dataclass
class ListDir:
    """Lists a folder in the tool's folder ("" or "." for the tool's folder itself)."""

    path: Path_


@xmlify(namespace=f"{NS}/file-list/v1", tag="entry")
@dataclass
class Entry:
    name: Annotated[str, MaxLen(1024)]
    kind: EntryKind
    size: int


@xmlify(namespace=f"{NS}/file-list/v1", tag="dir-listing", max_list_length=100_000)
@dataclass
class DirListing:
    """A folder's entries (symbolic links, FIFOs and devices are `other`)."""

    entry: list[Entry]


def _denied_unless_regular(st: os.stat_result, path: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        what = "directory" if stat.S_ISDIR(st.st_mode) else "FIFO, socket or device"
        raise Denied(f"not a regular file: {what}", path=shown(path))


def _not_found(path: str) -> HandlerResponse:
    return HandlerResponse.error("invalid-payload", f"no such file: {path[:256]}",
                                 retry_allowed=False)


# --- file-read ---------------------------------------------------------------------


class FileReader:
    def __init__(self, root: Root, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes

    def read(self, request: ReadFile) -> FileContent | None:
        """The content, or None when there is no such file."""
        parts = relative_parts(request.path)
        offset = request.offset or 0
        if offset < 0 or (request.length is not None and request.length < 0):
            raise ValueError("offset and length are not negative")
        want = self.max_bytes if request.length is None else min(request.length,
                                                                 self.max_bytes)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat refuses it.
            fd = self.root.open(parts, os.O_RDONLY | os.O_NONBLOCK, path=request.path)
        except (FileNotFoundError, NotADirectoryError):
            return None  # NotADirectory: a component on the way is a file
        except IsADirectoryError:
            raise Denied("not a regular file: directory", path=shown(request.path)) from None
        try:
            st = os.fstat(fd)
            _denied_unless_regular(st, request.path)
            chunks: list[bytes] = []
            got = 0
            while got < want:
                chunk = os.pread(fd, want - got, offset + got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
        finally:
            os.close(fd)
        encoding, data = as_xml_text(b"".join(chunks))
        return FileContent(path=request.path, size=st.st_size, encoding=encoding, data=data)

    async def __call__(self, payload: ReadFile, meta: HandlerMetadata) -> HandlerResponse:
        try:
            content = await asyncio.to_thread(self.read, payload)
        except ValueError as exc:
            return HandlerResponse.error("invalid-payload", str(exc), retry_allowed=False)
        if content is None:
            return _not_found(payload.path)
        return HandlerResponse.respond(content)


# --- file-write --------------------------------------------------------------------


class Exists(Exception):
    """`create` found the name taken."""


class FileWriter:
    def __init__(self, root: Root, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes

    def write(self, request: WriteFile) -> FileWritten | None:
        """Write atomically; None when a folder on the way does not exist."""
        parts = relative_parts(request.path)
        if not parts:
            raise Denied("not a regular file: directory", path=shown(request.path))
        data = _decode(request)
        if len(data) > self.max_bytes:
            raise Denied("data larger than max_bytes", path=shown(request.path),
                         size=str(len(data)))
        mode = request.mode or WriteMode.CREATE
        try:
            parent = self.root.open(parts[:-1], os.O_RDONLY | os.O_DIRECTORY,
                                    path=request.path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return self._write_in(parent, parts[-1], data, mode, request.path)
        finally:
            os.close(parent)

    def _write_in(self, parent: int, name: str, data: bytes, mode: WriteMode,
                  path: str) -> FileWritten:
        if name.startswith(_TEMP_PREFIX):
            raise Denied("name reserved for temporary files", path=shown(path))
        existing = self._existing(parent, name, path)
        if existing is not None and mode is WriteMode.CREATE:
            raise Exists
        if existing is not None and existing.st_nlink > 1:
            raise Denied("file has other hard links", path=shown(path))
        if mode is WriteMode.APPEND and existing is not None:
            if existing.st_size + len(data) > self.max_bytes:
                raise Denied("file would grow past max_bytes", path=shown(path))
            data = self._read_existing(parent, name, path) + data
        temp = self._temporary(parent, data, existing)
        try:
            if mode is WriteMode.CREATE or existing is None:
                # link, not rename: fails if the name was taken meanwhile.
                os.link(temp, name, src_dir_fd=parent, dst_dir_fd=parent,
                        follow_symlinks=False)
                os.unlink(temp, dir_fd=parent)
            else:
                os.replace(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except FileExistsError:
            os.unlink(temp, dir_fd=parent)
            raise Exists from None
        except BaseException:
            os.unlink(temp, dir_fd=parent)
            raise
        os.fsync(parent)
        return FileWritten(path=path, size=len(data))

    def _existing(self, parent: int, name: str, path: str) -> os.stat_result | None:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise Denied("symbolic link in path", path=shown(path))
        _denied_unless_regular(st, path)
        return st

    def _read_existing(self, parent: int, name: str, path: str) -> bytes:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=parent)
        try:
            st = os.fstat(fd)
            _denied_unless_regular(st, path)  # swapped for something else meanwhile
            if st.st_nlink > 1:
                raise Denied("file has other hard links", path=shown(path))
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _temporary(self, parent: int, data: bytes, existing: os.stat_result | None) -> str:
        """A new file in `parent` holding `data`, flushed to disk; its name."""
        temp = _TEMP_PREFIX + secrets.token_hex(8)
        # The old file's permission bits, never setuid, setgid or sticky: the content
        # is a caller's now.
        perms = 0o644 if existing is None else existing.st_mode & 0o777
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, perms, dir_fd=parent)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(temp, dir_fd=parent)
            raise
        os.close(fd)
        return temp

    async def __call__(self, payload: WriteFile, meta: HandlerMetadata) -> HandlerResponse:
        try:
            written = await asyncio.to_thread(self.write, payload)
        except ValueError as exc:
            return HandlerResponse.error("invalid-payload", str(exc), retry_allowed=False)
        except Exists:
            return HandlerResponse.error("invalid-payload", "the file exists (mode create)",
                                         retry_allowed=False)
        except IsADirectoryError:
            raise Denied("not a regular file: directory", path=shown(payload.path)) from None
        if written is None:
            return HandlerResponse.error("invalid-payload", "no such folder",
                                         retry_allowed=False)
        return HandlerResponse.respond(written)


def _decode(request: WriteFile) -> bytes:
    if request.encoding is Encoding.BASE64:
        try:
            return base64.b64decode(request.data, validate=True)
        except binascii.Error:
            raise ValueError("data is not valid base64") from None
    return request.data.encode("utf-8")


# --- file-list ---------------------------------------------------------------------


class DirLister:
    def __init__(self, root: Root, max_entries: int) -> None:
        self.root = root
        self.max_entries = max_entries

    def list(self, request: ListDir) -> DirListing | None:
        parts = relative_parts(request.path)
        try:
            fd = self.root.open(parts, os.O_RDONLY | os.O_DIRECTORY, path=request.path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        entries: list[Entry] = []
        try:
            with os.scandir(fd) as listing:
                for item in listing:
                    if len(entries) >= self.max_entries:
                        break
                    entry = _entry(item)
                    if entry is not None:
                        entries.append(entry)
        finally:
            os.close(fd)
        entries.sort(key=lambda e: e.name)
        return DirListing(entry=entries)

    async def __call__(self, payload: ListDir, meta: HandlerMetadata) -> HandlerResponse:
        listing = await asyncio.to_thread(self.list, payload)
        if listing is None:
            return HandlerResponse.error("invalid-payload", "no such folder",
                                         retry_allowed=False)
        return HandlerResponse.respond(listing)


def _entry(item: os.DirEntry[str]) -> Entry | None:
    """One listing entry; None for a name XML cannot carry (not valid UTF-8)."""
    name = item.name
    if ILLEGAL_XML_CHAR.search(name) or any("\udc80" <= c <= "\udcff" for c in name):
        return None
    try:
        st = item.stat(follow_symlinks=False)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
        return None  # removed while we listed
    if stat.S_ISREG(st.st_mode):
        return Entry(name=name, kind=EntryKind.FILE, size=st.st_size)
    if stat.S_ISDIR(st.st_mode):
        return Entry(name=name, kind=EntryKind.DIR, size=0)
    return Entry(name=name, kind=EntryKind.OTHER, size=0)


# --- describe (load) and handlers (wiring) ------------------------------------------

_KINDS: dict[str, tuple[type, type]] = {
    "file-read": (ReadFile, FileContent),
    "file-write": (WriteFile, FileWritten),
    "file-list": (ListDir, DirListing),
}


def describe(config: Any, listener: str) -> list[LoadedTool]:
    """The tool as loaded: its `tool:` block is all its handler needs."""
    payload, response = _KINDS[config.kind]
    return [LoadedTool(config.kind, listener, (payload,), (response,), payload.__doc__ or "",
                     config)]


def handlers(specs: Sequence[LoadedTool]) -> list[Handler]:
    return [_handler(spec.runs) for spec in specs]


def _handler(config: Any) -> Handler:
    root = Root(config.root)
    if config.kind == "file-read":
        return FileReader(root, config.max_bytes)
    if config.kind == "file-write":
        return FileWriter(root, config.max_bytes)
    return DirLister(root, config.max_entries)

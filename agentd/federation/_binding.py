"""The TLS channel binding `tls-exporter` (RFC 9266) of a live connection.

The handshake signs this value so that a signature made over one TLS connection
is worthless on any other: a relay that terminates TLS with its own certificate
sees two connections with two different exporter values, and a recorded handshake
replayed later meets a fresh one.

Python's `ssl` module does not expose `SSL_export_keying_material`, so this
module calls it through ctypes on the `SSL *` of the stdlib connection. The
pointer is read from CPython's `_ssl._SSLSocket` object (the field after the
weak reference to the socket, stable since 3.7); before it is used, the library
is asked what it knows about that pointer (protocol version, client or server
side, the negotiated cipher) and all of it must match what `ssl` reports, so a
layout change fails loudly instead of reading the wrong memory. The libssl
handle is the one already mapped into the process (the library `_ssl` uses),
never another copy found on disk.

Only TLS 1.3 is accepted: the exporter of TLS 1.2 without the extended master
secret is not a channel binding (RFC 9266, section 3).
"""

from __future__ import annotations

import ctypes
import ssl
import sys
from functools import cache

from agentd._errors import AgentdError

EXPORTER_LABEL = b"EXPORTER-Channel-Binding"
BINDING_BYTES = 32


class ChannelBindingUnavailable(AgentdError):
    """The exporter value of this connection cannot be obtained (and so no handshake)."""


@cache
def _libssl() -> ctypes.CDLL:
    path = _mapped_libssl()
    lib = ctypes.CDLL(path)
    lib.SSL_export_keying_material.argtypes = [
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
        ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    lib.SSL_export_keying_material.restype = ctypes.c_int
    lib.SSL_get_version.argtypes = [ctypes.c_void_p]
    lib.SSL_get_version.restype = ctypes.c_char_p
    lib.SSL_is_server.argtypes = [ctypes.c_void_p]
    lib.SSL_is_server.restype = ctypes.c_int
    lib.SSL_get_current_cipher.argtypes = [ctypes.c_void_p]
    lib.SSL_get_current_cipher.restype = ctypes.c_void_p
    lib.SSL_CIPHER_get_name.argtypes = [ctypes.c_void_p]
    lib.SSL_CIPHER_get_name.restype = ctypes.c_char_p
    return lib


def _mapped_libssl() -> str:
    """The path of the libssl the `_ssl` extension has loaded into this process."""
    import _ssl  # noqa: F401  (makes sure it is mapped)

    if sys.platform != "linux":
        raise ChannelBindingUnavailable("tls-exporter needs Linux (/proc/self/maps)")
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and "/libssl.so" in parts[5]:
                return parts[5]
    raise ChannelBindingUnavailable("libssl is not mapped into this process")


def _ssl_pointer(obj: ssl.SSLObject | ssl.SSLSocket) -> int:
    inner = getattr(obj, "_sslobj", None)  # the C-level _ssl._SSLSocket both classes wrap
    if inner is None:
        raise ChannelBindingUnavailable("the TLS connection is closed")
    offset = object.__basicsize__ + ctypes.sizeof(ctypes.c_void_p)
    return ctypes.c_void_p.from_address(id(inner) + offset).value or 0


def _check_pointer(lib: ctypes.CDLL, ptr: int, obj: ssl.SSLObject | ssl.SSLSocket) -> None:
    if not ptr:
        raise ChannelBindingUnavailable("no SSL object behind the connection")
    version = (lib.SSL_get_version(ptr) or b"").decode("ascii", "replace")
    cipher_ptr = lib.SSL_get_current_cipher(ptr)
    cipher = (lib.SSL_CIPHER_get_name(cipher_ptr) or b"").decode("ascii", "replace") \
        if cipher_ptr else ""
    expected_cipher = (obj.cipher() or ("",))[0]
    if (version != obj.version() or bool(lib.SSL_is_server(ptr)) != obj.server_side
            or cipher != expected_cipher):
        raise ChannelBindingUnavailable("the SSL object does not match the connection")


def tls_exporter(obj: ssl.SSLObject | ssl.SSLSocket) -> bytes:
    """The 32-byte `tls-exporter` value of a completed TLS 1.3 connection."""
    if obj.version() != "TLSv1.3":
        raise ChannelBindingUnavailable("tls-exporter needs TLS 1.3")
    lib = _libssl()
    ptr = _ssl_pointer(obj)
    _check_pointer(lib, ptr, obj)
    out = ctypes.create_string_buffer(BINDING_BYTES)
    ok = lib.SSL_export_keying_material(
        ptr, out, BINDING_BYTES, EXPORTER_LABEL, len(EXPORTER_LABEL), None, 0, 0)
    if ok != 1:
        raise ChannelBindingUnavailable("SSL_export_keying_material failed")
    return out.raw

"""A bus client's credential files: the TOTP secret file `agentd init` writes
(CLIENT.totp) and the session file a client keeps its token in. Light on purpose
(no websockets): `agentd totp` reads the first without loading the client."""

from __future__ import annotations

from pathlib import Path

import pyotp

from agentd._errors import AgentdError


def read_secret(path: str | Path) -> str:
    """A TOTP secret file: the base32 secret, or an otpauth:// URI, on one line."""
    from agentd.config import normalise_secret

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise AgentdError(f"cannot read secret file {path}: {exc.strerror or exc}") from None
    if text.startswith("otpauth://"):
        text = pyotp.parse_uri(text).secret
    try:
        return normalise_secret(text)
    except ValueError as exc:
        raise AgentdError(f"secret file {path}: {exc}") from None


def read_session_file(path: str | Path) -> tuple[str | None, str | None]:
    """(the bus URL the token was issued by, the token) from a session file: "URL\\nTOKEN";
    a file of one line is a bare token (URL None). (None, None) if there is none."""
    try:
        lines = Path(path).read_text(encoding="utf-8").split()
    except OSError:
        return None, None
    if len(lines) == 1:
        return None, lines[0]
    if len(lines) == 2:
        return lines[0], lines[1]
    return None, None


__all__ = ["read_secret", "read_session_file"]

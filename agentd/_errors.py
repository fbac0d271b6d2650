"""Error types. A rejection carries its `huh` code; the transport decides how to tell
the client. Messages here are generic on purpose: they go to the outside and must not
leak topology. Precise causes go to the logs through `detail`."""

from __future__ import annotations

from enum import StrEnum


class HuhCode(StrEnum):
    MALFORMED = "malformed"
    INVALID_ENVELOPE = "invalid-envelope"
    INVALID_PAYLOAD = "invalid-payload"
    UNROUTABLE = "unroutable"
    TOO_LARGE = "too-large"
    RATE_LIMITED = "rate-limited"
    BUDGET_EXCEEDED = "budget-exceeded"
    TIMEOUT = "timeout"
    DENIED = "denied"
    INTERNAL = "internal"


# The only texts that ever leave the process in a `huh`. One per code, so that two
# causes with the same code are indistinguishable from the outside.
GENERIC_MESSAGES: dict[HuhCode, str] = {
    HuhCode.MALFORMED: "The message is not well-formed XML.",
    HuhCode.INVALID_ENVELOPE: "The envelope is not valid.",
    HuhCode.INVALID_PAYLOAD: "The payload does not match its schema.",
    HuhCode.UNROUTABLE: "Message could not be delivered. Please verify your target and try again.",
    HuhCode.TOO_LARGE: "The message is too large.",
    HuhCode.RATE_LIMITED: "Too many messages; slow down and try again.",
    HuhCode.BUDGET_EXCEEDED: "The conversation has exhausted its budget.",
    HuhCode.TIMEOUT: "The handler did not answer in time.",
    HuhCode.DENIED: "The request is outside what this tool may do.",
    HuhCode.INTERNAL: "An internal error occurred.",
}

RETRY_ALLOWED: dict[HuhCode, bool] = {
    HuhCode.MALFORMED: True,
    HuhCode.INVALID_ENVELOPE: True,
    HuhCode.INVALID_PAYLOAD: True,
    HuhCode.UNROUTABLE: True,
    HuhCode.TOO_LARGE: True,
    HuhCode.RATE_LIMITED: True,
    HuhCode.BUDGET_EXCEEDED: False,
    HuhCode.TIMEOUT: True,
    HuhCode.DENIED: False,
    HuhCode.INTERNAL: True,
}


class AgentdError(Exception):
    """Base of every error agentd raises on purpose."""


class Rejection(AgentdError):
    """Input refused with a `huh` code. `detail` is for the logs only. `public`, when
    set, is what a client is told instead of the generic text when the refused
    input is its own envelope: it names only what that input holds (an element of
    its payload, a missing namespace), never a route, a listener or a peer."""

    def __init__(self, code: HuhCode, detail: str = "", public: str | None = None) -> None:
        super().__init__(f"{code.value}: {detail}" if detail else code.value)
        self.code = code
        self.detail = detail
        self.public = public

    @property
    def public_message(self) -> str:
        return GENERIC_MESSAGES[self.code]


class ValidationError(Rejection):
    """A payload did not validate against its schema (raised by `from_xml`)."""

    def __init__(self, detail: str = "", code: HuhCode = HuhCode.INVALID_PAYLOAD) -> None:
        super().__init__(code, detail)


class Denied(AgentdError):
    """Raised by a tool when its confinement refuses a request (a path outside its
    root, a host or an argument not allowed). The caller gets `huh denied` with the
    generic text; `cause` and `fields` go only to the log and to the journal, as a
    security event. `code` is `denied` unless the refusal is better told otherwise
    (an MCP tool whose server changed it since it was pinned is `unroutable`)."""

    def __init__(self, cause: str, *, code: HuhCode = HuhCode.DENIED, **fields: str) -> None:
        super().__init__(cause)
        self.cause = cause
        self.code = code
        self.fields = fields


class ConfigError(AgentdError):
    """The configuration is invalid. `issues` lists every problem with its location."""

    def __init__(self, issues: list[str]) -> None:
        super().__init__("\n".join(issues))
        self.issues = issues

"""The value types of the configuration: each says once what it accepts, what it
becomes and how it appears in the JSON Schema.

Scalars are strict (a quoted "8765" is not a port, `yes` in quotes is not a
boolean); a rule a type cannot express is an after-validator that raises a
`PydanticCustomError` whose message is the sentence the user reads. Paths are
resolved against the configuration's folder, passed in the validation context.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    AfterValidator,
    Field,
    PlainSerializer,
    PlainValidator,
    Strict,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError, PydanticKnownError
from pydantic_core.core_schema import ErrorType

from agentd.config import imports
from agentd.config.reader import ENTRY_ERROR
from agentd.kernel import (
    PRUNE_ON_DELIVERY_MODE,
    RETAIN_DAYS_MODE,
    RETAIN_FOREVER_MODE,
    Retention,
)

NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
# A peer organism's listener, in `peers` and profile members: GATEWAY:LISTENER.
REMOTE_PATTERN = re.compile(rf"(?:{NAME_PATTERN.pattern}):(?:{NAME_PATTERN.pattern})")
NAME_RULE = "use letters, digits, '_', '.', '-' (not first), at most 128 characters"
_BUILTIN_ERRORS = frozenset(typing.get_args(ErrorType))

# ------------------------------------------------------------ reporting many errors

class Problem(NamedTuple):
    """One of our rules failed at `loc` (below the value being validated)."""

    loc: tuple[str | int, ...]
    message: str  # what the user reads, or a pydantic error type ("missing", ...)
    input: Any
    at_entry: bool = False  # point at the entry holding the key, not at its value


def problem(message: str) -> PydanticCustomError:
    """One of our rules failed; `message` is what the user reads."""
    return PydanticCustomError("config", message)


def _error(found: Problem) -> Any:
    """A pydantic error type by name (worded by the reader), else one of ours."""
    if found.at_entry:
        return PydanticCustomError(ENTRY_ERROR, found.message)
    return found.message if found.message in _BUILTIN_ERRORS else problem(found.message)


def located(problems: Sequence[Problem], title: str = "configuration") -> ValidationError:
    """Several problems below the value being validated, each at its own location
    (pydantic nests the locations of an error raised inside a validator)."""
    return ValidationError.from_exception_data(
        title,
        [InitErrorDetails(type=_error(p), loc=p.loc, input=p.input) for p in problems],
    )


def merged(exc: ValidationError | None, problems: Sequence[Problem], title: str) -> None:
    """Raise pydantic's errors and ours together, if there are any."""
    details: list[InitErrorDetails] = [
        InitErrorDetails(type=_error(p), loc=p.loc, input=p.input) for p in problems
    ]
    for error in () if exc is None else exc.errors(include_url=False):
        kind = error["type"]
        details.append(
            InitErrorDetails(
                type=kind if kind in _BUILTIN_ERRORS else PydanticCustomError(kind, error["msg"]),
                loc=error["loc"],
                input=error["input"],
                ctx=error.get("ctx", {}),
            )
        )
    if details:
        raise ValidationError.from_exception_data(title, details)


Rule = Callable[[dict[str, Any], Mapping[str, Any]], list[Problem]]


def rules(check: Rule, title: str, prepare: Callable[[Any], Any] | None = None) -> Any:
    """A section's rules across its keys, as its wrap validator: `check` reads the
    raw mapping (and the validation context), so its problems are reported with
    pydantic's own even when a key fails; `prepare` may then amend the data."""

    def validate(
        cls: type, data: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> Any:
        problems = check(data, info.context or {}) if isinstance(data, dict) else []
        return checked(handler, data if prepare is None else prepare(data), problems, title)

    return model_validator(mode="wrap")(validate)


def checked(
    handler: Callable[[Any], Any], data: Any, problems: Sequence[Problem], title: str
) -> Any:
    """The wrap-validator step: validate `data`, then report its errors and the
    model's own rules (found on the raw data) in one go."""
    try:
        value = handler(data)
    except ValidationError as exc:
        merged(exc, problems, title)
        raise
    merged(None, problems, title)
    return value


# ------------------------------------------------------------------------ scalars


def _not_empty(value: str) -> str:
    if not value.strip():
        raise problem("must not be empty")
    return value


def _name(value: str) -> str:
    _not_empty(value)
    if not NAME_PATTERN.fullmatch(value):
        raise problem(f"invalid name {value!r}: {NAME_RULE}")
    return value


def _key_name(what: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if not NAME_PATTERN.fullmatch(value):
            raise problem(f"invalid {what} name {value!r}: use letters, digits, '_', '.', '-'")
        return value

    return check


def _host_port(value: str) -> str:
    _not_empty(value)
    if split_host_port(value) is None:
        raise problem(f"expected host:port (e.g. 127.0.0.1:9464 or [::1]:9464), got {value!r}")
    return value


def split_host_port(value: str) -> tuple[str, int] | None:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host or not re.fullmatch(r"[0-9A-Fa-f:.]+", host):
            return None
    elif not re.fullmatch(r"[A-Za-z0-9_.\-]+", host):
        return None
    return host, int(port)


def _url(value: str) -> str:
    _not_empty(value)
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", value):
        raise problem(f"expected an http:// or https:// URL, got {value!r}")
    return value


def _wss_url(value: str) -> str:
    _not_empty(value)
    if not re.fullmatch(r"wss://[^\s/]+(/\S*)?", value):
        raise problem(f"expected a wss:// URL, got {value!r}")
    return value


def _env_name(value: str) -> str:
    _not_empty(value)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise problem(f"not an environment variable name: {value!r}")
    return value


def _path(value: Any, info: ValidationInfo) -> Path:
    """`~` expanded; relative to the configuration's folder when there is one."""
    if isinstance(value, Path):
        return value
    if not isinstance(value, str):
        raise PydanticKnownError("string_type")
    _not_empty(value)
    if "\0" in value:
        raise problem("a path cannot contain a NUL character")
    base = (info.context or {}).get("base_dir")
    path = Path(value).expanduser()
    return path if base is None else base / path


def _prompt(value: str, info: ValidationInfo) -> str:
    """A prompt's text; `file:PATH` is replaced by the file's content."""
    _not_empty(value)
    if not value.startswith("file:"):
        return value
    relative = value[len("file:") :].strip()
    if not relative:
        raise problem("file: needs a path")
    file = _path(relative, info)
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise problem(f"prompt file not found: {file}") from None
    except UnicodeDecodeError:
        raise problem(f"prompt file is not UTF-8 text: {file}") from None
    except OSError as exc:
        raise problem(f"cannot read prompt file {file}: {exc.strerror or exc}") from None


def _folder(value: Path, info: ValidationInfo) -> Path:
    """A python_path folder, put on `sys.path` at once: the listeners after it in the
    file are imported in the same validation pass."""
    if not value.is_dir():
        raise problem(f"not a folder: {value}")
    context = info.context if isinstance(info.context, dict) else {}
    context["python_path_at"] = imports.add_import_folder(value, context.get("python_path_at", 0))
    return value


def _directory(value: Path) -> Path:
    """A folder a tool works in: it must exist when the configuration is loaded."""
    if not value.is_dir():
        raise problem(f"not a folder: {value}")
    return value


_STRING = {"type": "string"}
Int = Annotated[int, Strict()]
Positive = Annotated[int, Strict(), Field(ge=1)]
NonNegative = Annotated[int, Strict(), Field(ge=0)]
Port = Annotated[int, Strict(), Field(ge=0, le=65535)]
# Every duration is at most ten years: "never" written as 1e12 s would put deadlines past
# the year 9999, which no date type can show (approval expiries, `introspect timers`).
MAX_SECONDS = 315_576_000.0
Seconds = Annotated[float, Strict(), Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
NonNegativeNumber = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
PerSecond = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]  # a rate
Bool = Annotated[bool, Strict()]
Text = Annotated[str, Strict(), AfterValidator(_not_empty)]
AnyText = Annotated[str, Strict()]  # may be empty
Name = Annotated[
    str,
    Strict(),
    AfterValidator(_name),
    WithJsonSchema({"type": "string", "pattern": f"^{NAME_PATTERN.pattern}$"}),
]
ProfileName = Annotated[str, AfterValidator(_key_name("profile"))]
PromptName = Annotated[str, AfterValidator(_key_name("prompt"))]
HostPort = Annotated[str, Strict(), AfterValidator(_host_port)]
Url = Annotated[str, Strict(), AfterValidator(_url), WithJsonSchema({**_STRING, "format": "uri"})]
WssUrl = Annotated[
    str, Strict(), AfterValidator(_wss_url), WithJsonSchema({**_STRING, "format": "uri"})
]
EnvName = Annotated[str, Strict(), AfterValidator(_env_name)]
FilePath = Annotated[Path, PlainValidator(_path), WithJsonSchema(_STRING)]
Folder = Annotated[Path, PlainValidator(_path), AfterValidator(_folder), WithJsonSchema(_STRING)]
# A directory that is only checked, never put on sys.path (a tool's root, a preopen).
Directory = Annotated[
    Path, PlainValidator(_path), AfterValidator(_directory), WithJsonSchema(_STRING)
]
Prompt = Annotated[str, Strict(), AfterValidator(_prompt)]
Synchronous = Literal["NORMAL", "FULL"]

# ---------------------------------------------------------------------- retention


def _retention(value: Any) -> Retention:
    """`retain_forever`, `prune_on_delivery` or `{retain_days: N}`: the one parser."""
    if isinstance(value, Retention):
        return value
    if isinstance(value, dict):
        problems: list[Problem] = [
            Problem((key,), f"unknown key; expected one of: {RETAIN_DAYS_MODE}", value[key])
            for key in value
            if key != RETAIN_DAYS_MODE
        ]
        days = value.get(RETAIN_DAYS_MODE)
        if RETAIN_DAYS_MODE not in value:
            problems.append(Problem((RETAIN_DAYS_MODE,), "missing", value))
        elif not isinstance(days, int) or isinstance(days, bool):
            problems.append(Problem((RETAIN_DAYS_MODE,), "int_type", days))
        elif days < 1:
            problems.append(Problem((RETAIN_DAYS_MODE,), "must be at least 1", days))
        if problems or not isinstance(days, int):
            raise located(problems, "retention")
        return Retention(RETAIN_DAYS_MODE, float(days))
    if not isinstance(value, str):
        raise PydanticKnownError("string_type")
    if value in (RETAIN_FOREVER_MODE, PRUNE_ON_DELIVERY_MODE):
        return Retention(value)
    raise problem(
        f"expected {RETAIN_FOREVER_MODE}, {PRUNE_ON_DELIVERY_MODE} or "
        f"{{{RETAIN_DAYS_MODE}: N}}; got {value!r}"
    )


def _written_retention(value: Retention) -> Any:
    """A policy as one writes it (the schema's defaults show it so)."""
    if value.mode == RETAIN_DAYS_MODE:
        return {RETAIN_DAYS_MODE: value.days}
    return value.mode


RetentionValue = Annotated[
    Retention,
    PlainValidator(_retention),
    PlainSerializer(_written_retention),
    WithJsonSchema(
        {
            "anyOf": [
                {"enum": [RETAIN_FOREVER_MODE, PRUNE_ON_DELIVERY_MODE]},
                {
                    "type": "object",
                    "properties": {RETAIN_DAYS_MODE: {"type": "integer", "minimum": 1}},
                    "required": [RETAIN_DAYS_MODE],
                    "additionalProperties": False,
                },
            ]
        }
    ),
]

# -------------------------------------------------------------------- name lists


def unique_names(items: Iterable[Any]) -> tuple[tuple[str, ...], list[Problem]]:
    """Names in order, and a problem for each one that is invalid or listed twice."""
    names: list[str] = []
    problems: list[Problem] = []
    for i, item in enumerate(items):
        if not isinstance(item, str):
            problems.append(Problem((i,), "string_type", item))
            continue
        try:
            if not REMOTE_PATTERN.fullmatch(item):
                _name(item)
        except PydanticCustomError as exc:
            problems.append(Problem((i,), exc.message(), item))
            continue
        if item in names:
            problems.append(Problem((i,), f"{item!r} is listed twice", item))
            continue
        names.append(item)
    return tuple(names), problems


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise PydanticKnownError("list_type")
    names, problems = unique_names(value)
    if problems:
        raise located(problems, "names")
    return names


def _members(value: Any) -> tuple[str, ...] | Literal["all"]:
    if isinstance(value, str):
        if value == "all":
            return "all"
        raise problem(f"expected `all` or a list of listener names; got {value!r}")
    return _names(value)


_NAME_LIST_SCHEMA = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
Names = Annotated[tuple[str, ...], PlainValidator(_names), WithJsonSchema(_NAME_LIST_SCHEMA)]
Members = Annotated[
    tuple[str, ...] | Literal["all"],
    PlainValidator(_members),
    WithJsonSchema({"anyOf": [{"const": "all"}, _NAME_LIST_SCHEMA]}),
]

# ------------------------------------------------------------ module:attribute refs


class Imported(NamedTuple):
    """What a `module:attribute` reference named, and the reference as written."""

    ref: str
    value: Any


def _handler(value: Any) -> Imported:
    if isinstance(value, Imported):
        return value
    if not isinstance(value, str):
        raise PydanticKnownError("string_type")
    _not_empty(value)
    try:
        return Imported(value, imports.resolve_handler(value))
    except imports.ReferenceProblem as exc:
        raise problem(str(exc)) from None


def _classes(value: Any) -> tuple[Imported, ...]:
    """One `module:Class` or a list of them; each an @xmlify dataclass, once."""
    if isinstance(value, tuple) and all(isinstance(v, Imported) for v in value):
        return value
    items: list[tuple[tuple[int, ...], Any]]
    if isinstance(value, list | tuple):
        if not value:
            raise problem("the list is empty")
        items = [((i,), item) for i, item in enumerate(value)]
    else:
        items = [((), value)]
    out: list[Imported] = []
    problems: list[Problem] = []
    for loc, item in items:
        try:
            imported = _import_class(item)
        except PydanticCustomError as exc:
            problems.append(Problem(loc, exc.message(), item))
            continue
        except PydanticKnownError as exc:
            problems.append(Problem(loc, exc.type, item))
            continue
        if any(done.value is imported.value for done in out):
            problems.append(Problem(loc, f"{item} is listed twice", item))
            continue
        out.append(imported)
    if problems:
        raise located(problems, "classes")
    return tuple(out)


def _import_class(item: Any) -> Imported:
    if not isinstance(item, str):
        raise PydanticKnownError("string_type")
    _not_empty(item)
    try:
        return Imported(item, imports.resolve_class(item, is_payload=_xmlify().is_xmlified))
    except imports.ReferenceProblem as exc:
        raise problem(str(exc)) from None


def _xmlify() -> Any:
    # Imported late: the schema layer imports the configuration's error type.
    from agentd import _xmlify as module

    return module


_REF_SCHEMA = {"type": "string", "pattern": f"^{imports.REFERENCE.pattern}$"}
HandlerRef = Annotated[Imported, PlainValidator(_handler), WithJsonSchema(_REF_SCHEMA)]
ClassRefs = Annotated[
    tuple[Imported, ...],
    PlainValidator(_classes),
    WithJsonSchema(
        {"anyOf": [_REF_SCHEMA, {"type": "array", "items": _REF_SCHEMA, "minItems": 1}]}
    ),
]


# ---- the user a confined process runs as ------------------------------------------------


def user_ids(user: str) -> tuple[int, int]:
    """(uid, gid) of a user name or numeric uid (its primary group); KeyError if unknown."""
    import pwd

    entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid


def unknown_user(data: Mapping[str, Any]) -> list[Problem]:
    """An `isolation:` block's `user` must exist on this host."""
    user = data.get("user")
    if not isinstance(user, str):
        return []
    try:
        user_ids(user)
    except (KeyError, ValueError, OverflowError):
        return [Problem(("user",), f"no such user: {user}", user, at_entry=True)]
    return []


def run_as(user: str | None, where: str) -> tuple[int | None, int | None]:
    """The (uid, gid) a confined process switches to: None, None without `user` (the
    daemon's own). Another user needs the daemon to run as root: refused (ConfigError
    naming `where`) rather than ignored, since the operator asked for the separation."""
    from agentd._errors import ConfigError
    from agentd._secrets import daemon_uid

    if user is None:
        return None, None
    uid, gid = user_ids(user)
    runs_as = daemon_uid()
    if runs_as != 0 and uid != runs_as:
        raise ConfigError([f"{where}: isolation: user: {user}: a process can run as another "
                           "user only when the daemon runs as root"])
    return uid, gid

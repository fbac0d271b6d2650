"""An `exec` tool's command line: the configured argv with `{name}` placeholders, and
the pure decision of what argv a call's arguments give.

No shell ever sees the result: each element is one `execve` argument, and a value
fills its placeholder inside one element, whatever it contains (spaces, `;`, `$(…)`,
backticks, quotes, newlines are just characters). The program (`argv[0]`) has no
placeholder. Every placeholder must have an `allow_args` pattern, and a value must
match it in full (`re.fullmatch`).

Option injection: a value that begins an argument and begins with `-` is refused,
unless the operator's pattern itself begins with `-` (or `\\-`), the explicit way
to say that this argument is an option (`allow_args: {flag: "-[vq]"}`). A value
begins its argument when its placeholder starts the element, or follows only
placeholders whose values are empty (`{dir}{file}` with an empty `dir`): the check
is made on the filled argument. `--output={file}` is safe either way: the element
starts with the operator's text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agentd._errors import Denied

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_-]*)\}")
_FIELD_CHARS = 200


def _shown(value: str) -> str:
    text = value[:_FIELD_CHARS].encode("unicode_escape").decode("ascii")
    return text + ("…" if len(value) > _FIELD_CHARS else "")


class TemplateError(ValueError):
    """The configured argv cannot be used (a configuration error)."""


@dataclass(frozen=True)
class CommandTemplate:
    argv: tuple[str, ...]
    patterns: Mapping[str, re.Pattern[str]]
    # Names whose placeholder starts an element, so a value there could be an option
    # (checked before the pattern; `fill` checks the filled argument too).
    leading: frozenset[str]
    options_allowed: frozenset[str]

    @classmethod
    def parse(cls, argv: Sequence[str], allow_args: Mapping[str, str]) -> CommandTemplate:
        if not argv:
            raise TemplateError("argv is empty")
        if PLACEHOLDER.search(argv[0]):
            raise TemplateError("the program (argv[0]) cannot contain a placeholder")
        names: set[str] = set()
        leading: set[str] = set()
        for element in argv[1:]:
            for match in PLACEHOLDER.finditer(element):
                names.add(match.group(1))
                if match.start() == 0:
                    leading.add(match.group(1))
        missing = sorted(names - set(allow_args))
        if missing:
            raise TemplateError(f"placeholders without an allow_args pattern: "
                                f"{', '.join(missing)}")
        unused = sorted(set(allow_args) - names)
        if unused:
            raise TemplateError(f"allow_args names no placeholder: {', '.join(unused)}")
        patterns = {name: re.compile(allow_args[name]) for name in names}
        options = frozenset(n for n in names
                            if allow_args[n].startswith(("-", "\\-")))
        return cls(tuple(argv), patterns, frozenset(leading), options)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.patterns)

    def fill(self, args: Sequence[tuple[str, str]]) -> list[str]:
        """The argv for one call; `Denied` for an argument the configuration does
        not allow, `ValueError` for one missing or given twice."""
        values: dict[str, str] = {}
        for name, value in args:
            if name not in self.patterns:
                raise Denied("unknown argument", arg=_shown(name))
            if name in values:
                raise ValueError(f"argument {name!r} given twice")
            if "\x00" in value:
                raise Denied("NUL byte in argument", arg=name)
            if value.startswith("-") and name in self.leading \
                    and name not in self.options_allowed:
                raise Denied("argument would be read as an option", arg=name,
                             value=_shown(value))
            if not self.patterns[name].fullmatch(value):
                raise Denied("argument does not match its allow_args pattern", arg=name,
                             value=_shown(value))
            values[name] = value
        missing = sorted(self.names - set(values))
        if missing:
            raise ValueError(f"missing arguments: {', '.join(missing)}")
        argv = [self.argv[0]]
        for element in self.argv[1:]:
            filled = PLACEHOLDER.sub(lambda m: values[m.group(1)], element)
            if filled.startswith("-") and not element.startswith("-"):
                # The dash is a value's: the first non-empty one the element starts with
                # (`{dir}{file}` with an empty `dir`).
                name = next(n for n in _leading_run(element) if values[n])
                if name not in self.options_allowed:
                    raise Denied("argument would be read as an option", arg=name,
                                 value=_shown(values[name]))
            argv.append(filled)
        return argv


def _leading_run(element: str) -> list[str]:
    """The names of the placeholders `element` starts with, back to back."""
    run: list[str] = []
    at = 0
    for match in PLACEHOLDER.finditer(element):
        if match.start() != at:
            break
        at = match.end()
        run.append(match.group(1))
    return run

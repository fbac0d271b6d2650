"""The exec tool's argv decision, without a process: placeholders fill one element
each, values match their pattern in full, options are not injected."""

from __future__ import annotations

import pytest

from agentd.tools import Denied
from agentd.tools.command import CommandTemplate, TemplateError

GREP = CommandTemplate.parse(
    ["/bin/grep", "-n", "--", "{pattern}", "{file}"],
    {"pattern": r"[\w /.*$();`|&<>'\"-]{1,64}", "file": r"[\w.]+"})


def test_each_value_fills_exactly_one_element() -> None:
    assert GREP.fill([("pattern", "a b; rm -rf /"), ("file", "x.txt")]) == [
        "/bin/grep", "-n", "--", "a b; rm -rf /", "x.txt"]


@pytest.mark.parametrize("value", [
    "$(id)", "`id`", "x; cat /etc/shadow", "a | nc evil 1", "a && b", "'quoted'", "$HOME",
    "> /tmp/out",
])
def test_shell_metacharacters_are_plain_characters_of_one_argument(value: str) -> None:
    argv = GREP.fill([("pattern", value), ("file", "f")])
    assert argv[3] == value and len(argv) == 5


@pytest.mark.parametrize("value", ["-e", "--output=/etc/passwd", "-rf"])
def test_option_injection_is_refused(value: str) -> None:
    with pytest.raises(Denied) as info:
        GREP.fill([("pattern", value), ("file", "f")])
    assert info.value.cause == "argument would be read as an option"


def test_an_option_behind_empty_placeholders_is_refused() -> None:
    """`{dir}{sep}{file}`: with the values before it empty, `file` begins the argument."""
    sort = CommandTemplate.parse(["/usr/bin/sort", "{dir}{sep}{file}"],
                                 {"dir": "[a-z/]*", "sep": "/?", "file": ".*"})
    with pytest.raises(Denied) as info:
        sort.fill([("dir", ""), ("sep", ""), ("file", "--version")])
    assert info.value.cause == "argument would be read as an option"
    assert info.value.fields["arg"] == "file"
    # Behind a value that is not empty, the same value is an ordinary argument.
    assert sort.fill([("dir", "d"), ("sep", "/"), ("file", "-x")])[1] == "d/-x"
    assert sort.fill([("dir", ""), ("sep", "/"), ("file", "-x")])[1] == "/-x"


def test_an_option_argument_is_allowed_when_the_pattern_says_so() -> None:
    ls = CommandTemplate.parse(["/bin/ls", "{flag}", "--color={when}"],
                               {"flag": "-[la]", "when": "-?[a-z]+"})
    assert ls.fill([("flag", "-l"), ("when", "-never")]) == ["/bin/ls", "-l", "--color=-never"]


NO_MATCH = "argument does not match its allow_args pattern"


@pytest.mark.parametrize(("args", "cause"), [
    ([("pattern", "x"), ("file", "../etc/passwd")], NO_MATCH),
    ([("pattern", "x"), ("file", "a\nb")], NO_MATCH),
    ([("pattern", "x"), ("file", "f"), ("extra", "y")], "unknown argument"),
    ([("pattern", "x\x00y"), ("file", "f")], "NUL byte in argument"),
])
def test_arguments_outside_the_configuration_are_denied(
    args: list[tuple[str, str]], cause: str,
) -> None:
    with pytest.raises(Denied) as info:
        GREP.fill(args)
    assert info.value.cause == cause


def test_full_match_not_search() -> None:
    t = CommandTemplate.parse(["/bin/echo", "{n}"], {"n": "[0-9]+"})
    with pytest.raises(Denied):
        t.fill([("n", "1; id")])


def test_missing_or_repeated_arguments_are_invalid_not_denied() -> None:
    with pytest.raises(ValueError, match="missing"):
        GREP.fill([("pattern", "x")])
    with pytest.raises(ValueError, match="twice"):
        GREP.fill([("pattern", "x"), ("pattern", "y"), ("file", "f")])


@pytest.mark.parametrize(("argv", "allow", "needle"), [
    ([], {}, "empty"),
    (["{prog}"], {"prog": ".*"}, "argv[0]"),
    (["/bin/echo", "{x}"], {}, "without an allow_args pattern: x"),
    (["/bin/echo"], {"x": ".*"}, "names no placeholder: x"),
])
def test_bad_templates_are_configuration_errors(
    argv: list[str], allow: dict[str, str], needle: str,
) -> None:
    with pytest.raises(TemplateError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        CommandTemplate.parse(argv, allow)

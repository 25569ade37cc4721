"""Which distilled advice may be kept: a complete sentence that names only functions and
arguments the task's environment has.

A small role model's answer can be valid JSON and still be unusable: cut off mid-thought
("... call get_stock_info and write: {"), or naming a call the environment cannot take
(``send_message(symbol='NAPD')``: send_message has no argument ``symbol``). Put into a
prompt, such advice teaches the policy the mistake. What is checked:

- complete: every bracket, double quote, backtick and opening single quote is closed,
  the text does not end on a character or word that needs more after it (``:``, ``,``,
  ``(``, ``...``, "and", "then"), and a condition ("When asked to ...", "If ...") is
  followed by what to do;
- names: ``name(...)`` must be one of the environment's functions and each ``key=`` in its
  parentheses one of that function's arguments; any other snake_case word (how function
  and argument names are written) must name a function or an argument. Quoted text is a
  value, not a name, and is not checked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from coevolve.shared.structured import Rejection

CLOSERS = {"(": ")", "[": "]", "{": "}"}
# symmetric quotes; a single quote opens only where no letter or digit precedes it (not
# the apostrophe of "agent's") and closes only where none follows
SYMMETRIC_QUOTES = ('"', "`")
DANGLING_ENDS = (":", ",", ";", "=", "-", "(", "[", "{", "...", "…")
# words a sentence does not end on
DANGLING_WORDS = frozenset(
    {"a", "an", "and", "as", "by", "call", "for", "from", "in", "of", "on", "or", "the"}
    | {"then", "to", "use", "with", "write"}
)
_CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\(")
_KEYWORD = re.compile(r"(?<![\w.=!<>])([A-Za-z_]\w*)\s*=(?!=)")
# snake_case, not part of a path, a dotted name or a file name (report_1.txt)
_SNAKE = re.compile(r"(?<![\w./\\-])([A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+)(?![\w/\\-]|\.\w)")
_LAST_WORD = re.compile(r"([A-Za-z]+)$")
# a sentence that opens with a condition; what to do follows a comma, colon or "then"
_CONDITION = re.compile(r"^\s*(when|whenever|if|before|after|once)\b", re.IGNORECASE)
_MAIN_CLAUSE = re.compile(r"[,:;]|\bthen\b|\.\s+\S", re.IGNORECASE)


def advice_problem(text: str, tools: Sequence[Mapping[str, Any]]) -> Rejection | None:
    """Why ``text`` may not be kept as advice in an environment offering ``tools``
    (OpenAI-style function schemas), or None: it may."""
    unquoted, unclosed = without_quoted(text)
    if unclosed is not None:
        return Rejection("incomplete", f"{unclosed}: {text!r}")
    if dangling_end(text):
        return Rejection("incomplete", f"it ends mid-sentence: {text!r}")
    arguments = arguments_by_function(tools)
    every_argument = {name for names in arguments.values() for name in names}
    for match in _CALL.finditer(unquoted):
        function = match.group(1)
        if function not in arguments:
            return Rejection("unknown_function", f"the environment has no {function}: {text!r}")
        inside = unquoted[match.end() : closing_paren(unquoted, match.end() - 1)]
        for keyword in _KEYWORD.findall(inside):
            if keyword not in arguments[function]:
                return Rejection(
                    "unknown_argument", f"{function} has no argument {keyword}: {text!r}"
                )
    for name in _SNAKE.findall(unquoted):
        if name not in arguments and name not in every_argument:
            return Rejection("unknown_name", f"{name} is no function or argument here: {text!r}")
    if condition_only(unquoted):
        return Rejection("incomplete", f"a condition with nothing to do: {text!r}")
    return None


def arguments_by_function(tools: Sequence[Mapping[str, Any]]) -> dict[str, frozenset[str]]:
    """Function name -> the names of its arguments."""
    found: dict[str, frozenset[str]] = {}
    for tool in tools:
        function = tool.get("function", tool)
        name = function.get("name")
        if isinstance(name, str):
            properties = (function.get("parameters") or {}).get("properties") or {}
            found[name] = frozenset(properties)
    return found


def without_quoted(text: str) -> tuple[str, str | None]:
    """``text`` with what its quotes enclose blanked out, and what is left unclosed (an
    open quote or bracket, or a bracket closed that was never opened), if anything."""
    kept: list[str] = []
    brackets: list[str] = []
    quote: str | None = None
    for index, char in enumerate(text):
        before = text[index - 1] if index else " "
        after = text[index + 1] if index + 1 < len(text) else " "
        if quote is not None:
            if char == quote and (quote != "'" or not after.isalnum()):
                quote = None
                kept.append(char)
            else:
                kept.append(" ")
            continue
        kept.append(char)
        if char in SYMMETRIC_QUOTES or (char == "'" and not before.isalnum()):
            quote = char
        elif char in CLOSERS:
            brackets.append(CLOSERS[char])
        elif char in CLOSERS.values() and (not brackets or brackets.pop() != char):
            return "".join(kept), f"a {char} that closes nothing open"
    if quote is not None:
        return "".join(kept), f"an unclosed {quote}"
    if brackets:
        return "".join(kept), f"an unclosed bracket (no {brackets[-1]})"
    return "".join(kept), None


def dangling_end(text: str) -> bool:
    """Whether ``text`` ends where a sentence cannot: on ``:``, ``,``, an opening bracket,
    an ellipsis, or a word such as "and" with no full stop after it."""
    end = text.rstrip()
    if end.endswith(DANGLING_ENDS):
        return True
    last = _LAST_WORD.search(end)
    return last is not None and last.group(1).lower() in DANGLING_WORDS


def condition_only(unquoted: str) -> bool:
    """Whether ``unquoted`` (quoted text blanked) is a condition alone: it opens with
    "When", "If" and the like, and no comma, colon or "then" outside brackets leads on to
    what to do ("When asked to call remove_stock_from_watchlist(symbol='AAPL')")."""
    if not _CONDITION.match(unquoted):
        return False
    return _MAIN_CLAUSE.search(outside_brackets(unquoted)) is None


def outside_brackets(text: str) -> str:
    """``text`` without what its brackets enclose (the arguments of a call)."""
    kept, depth = [], 0
    for char in text:
        if char in CLOSERS:
            depth += 1
        elif char in CLOSERS.values():
            depth = max(depth - 1, 0)
        elif depth == 0:
            kept.append(char)
    return "".join(kept)


def closing_paren(text: str, opening: int) -> int:
    """The index of the ``)`` that closes the ``(`` at ``opening`` (the text's end when
    none does)."""
    depth = 0
    for index in range(opening, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                return index
    return len(text)

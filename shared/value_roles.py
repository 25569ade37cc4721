"""Whether a substituted value keeps its role in a request.

A substitution child is a parent turn with one value (old) swapped for another (new) in
its calls and its request. Its request must write the new value where the parent wrote
the old one (or named it in words), not where it wrote another party's value: a parent
"I (user id USR001) need to ... communicate with Jane" whose call sends to ``USR002``,
swapped ``USR002`` -> ``USR004``, became "I (user id USR004) ..." in a default run (3 of
24 accepted tasks) while the call sent to ``USR004``: the sender took the receiver's id.

Shared by the abstractor (which asks again for such an edit) and the judge (which
rejects such a task).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from coevolve.shared.argument_values import scalars
from coevolve.shared.messages import ToolCall

# a word with what ids, codes, file names, dates and numbers are made of ("USR001",
# "report.txt", "2024-03-01", "1,000"); a comma only between digits
_TOKEN = re.compile(r"(?<![\w@])[\w@](?:[\w.@/-]|(?<=\d),(?=\d))*")
# a quoted literal: 'x' or "x" (not an apostrophe inside a word)
_QUOTED = re.compile(r"(?:^|(?<=[\s(\[:,]))['\"‘“]([^'\"’”\n]{1,80}?)['\"’”](?=$|[\s.,;:!?)\]])")
_FILE_NAME = re.compile(r"[\w-]+\.[A-Za-z0-9]{1,5}")


def shape(value: Any) -> str:
    """How a value is written, runs collapsed: ``USR005`` -> ``A9``, ``NVDA`` -> ``A``,
    ``Jane`` -> ``Aa``; values written alike are of one kind (a user id for a user id)."""
    text = re.sub(r"[A-Z]+", "A", re.sub(r"[a-z]+", "a", re.sub(r"[0-9]+", "9", str(value))))
    return re.sub(r"\s+", " ", text)


def mention(value: Any) -> re.Pattern[str]:
    """``value`` as a whole token: ``USR005`` in "'USR005'." but not in ``USR0051``."""
    return re.compile(rf"(?<![\w.]){re.escape(str(value))}(?![\w])")


def writes(text: str, value: Any) -> bool:
    """Whether ``text`` writes ``value`` as it is, as a whole token."""
    return mention(value).search(text) is not None


def _value_like(token: str) -> bool:
    """A token written like a value rather than a word: with a digit (an id, a number, a
    date), in capitals (a ticker, a code), a file name or an address; a name ("Jane") is
    a word."""
    has_letters = any(c.isalpha() for c in token)
    return (
        any(c.isdigit() for c in token)
        or (len(token) > 1 and has_letters and token.isupper())
        or _FILE_NAME.fullmatch(token) is not None
        or "@" in token
    )


def written_values(text: str) -> list[str]:
    """The values ``text`` writes out, in order, each once: what it quotes, and its
    id-like tokens and numbers (:func:`_value_like`)."""
    found = [quoted.strip() for quoted in _QUOTED.findall(text) if quoted.strip()]
    for token in _TOKEN.findall(text):
        token = token.rstrip(".-/")
        if token and _value_like(token):
            found.append(token)
    return list(dict.fromkeys(found))


def role_problems(
    parent_request: str, request: str, old: Any, new: Any, calls: Sequence[ToolCall]
) -> list[str]:
    """Why ``request``, a substitution child of ``parent_request`` whose calls (``calls``)
    swapped ``old`` for ``new``, does not keep the parties' roles; [] when it does.

    - a value the parent writes apart from ``old``, written like ``new`` (same
      :func:`shape`), that ``request`` no longer writes while it writes ``new``: the new
      value took that party's place;
    - ``request`` still writes ``old`` as the parent did, while the calls pass ``new``
      and no longer ``old``: the swap was made in the calls only.
    """
    if isinstance(old, bool) or isinstance(new, bool):
        return []
    problems: list[str] = []
    if writes(request, new):
        apart_from_old = mention(old).sub(" ", parent_request)
        for value in written_values(apart_from_old):
            if value in (str(old), str(new)) or shape(value) != shape(new):
                continue
            if not writes(request, value):
                problems.append(
                    f"the request writes {new} where its parent wrote {value}, but the swap "
                    f"replaced {old}: the new value names another party"
                )
    passed = [value for call in calls for value in scalars(call.arguments)]
    # "server error" for "error" writes the old value inside the new one
    still_written = writes(mention(new).sub(" ", request), old)
    if writes(parent_request, old) and still_written and new in passed and old not in passed:
        problems.append(
            f"the request still writes {old}, which its calls no longer pass (they pass "
            f"{new}): the swap was made in the calls only"
        )
    return problems

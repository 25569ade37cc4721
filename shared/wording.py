"""How a request is worded: plain English, asking for what its calls do.

The abstractor refuses, and the judge rejects, requests with these two faults, which
replaying the calls cannot see:

- call syntax: ``remove_from_watchlist({"stock": "Zeta Corp"})``, a JSON object, a
  function's identifier, a function's name with only a "Details:" clause
  (``touch Details: file name 'notes.md'.``). A user does not write these, and a policy
  trained on them learns to read code, not requests. Identifiers are only those with an
  underscore or an inner capital (``add_to_watchlist``, ``lockDoors``): one-word
  functions (``cd``, ``sort``, ``touch``) are ordinary words in a request.
- the opposite action: the request says "remove" (and never "add") while its call is
  ``add_to_watchlist``, in an environment that offers a function that removes. Its
  salient values may all be named, and its text is still close to the called function.

- a template (:func:`template_request`): a request filled from a function's documentation
  instead of said by a user: a "Details:" list of values, a function's name in words and a
  colon opening it ("delete message: Delete the latest message sent to a receiver",
  "message login: User 'USR002' logged in successfully."), a tool's description copied, a
  "key value; key value" list. Default runs accepted 7 of 9 requests of this kind.

On the 731 per-turn tasks of BFCL's multi_turn_base, call syntax flags none and the
opposite action one (a turn whose ground truth cancels a booking it never mentions).
:func:`template_request` flags none of the 3,336 user turns of BFCL's four multi-turn
categories (200 of them, miss_func's, empty), each read against the functions,
descriptions and parameters of its entry's classes; the most any of them copies from a
description is 57% of its words ("Reveal the contents of a different file.", in runs of
``COPIED_RUN`` words), against ``MIN_COPIED_SHARE`` 75%.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

# (one action's verbs, the opposite action's verbs); a function's action is the first
# word of its name
OPPOSITE_ACTIONS: tuple[tuple[frozenset[str], frozenset[str]], ...] = tuple(
    (frozenset(these), frozenset(those))
    for these, those in (
        ({"add", "include", "insert", "put"}, {"remove", "delete", "drop"}),
        ({"follow"}, {"unfollow"}),
        ({"lock"}, {"unlock"}),
        ({"press"}, {"release"}),
        ({"book", "reserve"}, {"cancel"}),
        ({"place", "buy", "purchase"}, {"cancel", "sell"}),
        ({"fund", "deposit"}, {"withdraw"}),
        ({"create", "open"}, {"close", "delete"}),
        ({"login"}, {"logout"}),
        ({"start"}, {"stop"}),
    )
)

# a name directly followed by parentheses that are empty or hold arguments (=, :, quotes,
# brackets): ``f()``, ``cd(folder='x')``; not "file(s)" nor "Nvidia (NVDA)"
_CALL = re.compile(r"\b[A-Za-z_]\w*\((?:\s*|[^()]*[=:{\[\"'][^()]*)\)")
_JSON_OBJECT = re.compile(r"\{\s*[\"']\w+[\"']\s*:")
# an argument's identifier assigned a value ("base_currency = 'USD'"), and a phrase said
# three times over (a model's degenerate loop); none of BFCL's 731 base turns has either
_ASSIGNMENT = re.compile(r"\b[A-Za-z]+(?:_[A-Za-z]+)+\s*=")
_REPEATED = re.compile(r"\b(\w+(?:\W+\w+){1,5})(?:\W+\1\b){2,}", re.IGNORECASE)
# log lines: the abstractor's own prompt echoed ("arguments: x = 1 returned: {"), also as
# "arguments(user id)" (run 28, accepted), and an HTTP request line; none of BFCL's 731
# base turns has either
_LOG_LINE = re.compile(r"\b(?:arguments|returned)\s*[:(]|\b(?:GET|POST|PUT|PATCH|DELETE)\s+\S*/")
_WORD = re.compile(r"[a-z]+")
# a request that speaks of the call, the assistant or the request itself ("What does this
# call do?", "the assistant needs to ...") describes the task instead of asking it; none of
# BFCL's 2,924 multi-turn user turns (four categories) says any of these, nor the
# abstractor's prompt echoed ("make 1 call, it does Log in a user ...", run 28, accepted)
_ABOUT_THE_TASK = re.compile(
    r"\b(?:this|that|the|each|these)\s+calls?\b|\bthe assistant\b|\b(?:your|this|the|my) request\b"
    r"|\b\d+ calls?\b|\bit does\b",
    re.IGNORECASE,
)
# the abstractor's completion appends the values a request leaves out as "Details: ..."
_DETAILS = re.compile(r"\bDetails:.*$", re.DOTALL)
# words a request may put between the words of a function's name ("get the current speed")
_ARTICLES = r"(?: (?:the|a|an|my|your|our|its|their|this|that|some))* "
MIN_PLAIN_WORDS = 2  # "What's inside?" is a BFCL request


def without_details(request: str) -> str:
    """The request as written, without the "Details:" clause the abstractor appends."""
    return _DETAILS.sub("", request)


def name_words(function: str) -> list[str]:
    """``add_to_watchlist`` -> [add, to, watchlist]; ``lockDoors`` -> [lock, doors]."""
    return [w for w in re.sub(r"([a-z])([A-Z])", r"\1_\2", function).lower().split("_") if w]


def is_identifier(function: str) -> bool:
    return "_" in function or re.search(r"[a-z][A-Z]", function) is not None


def call_syntax(request: str, functions: Iterable[str]) -> list[str]:
    """What in ``request`` is not plain English: call syntax (a call, a JSON object, a
    function's identifier, an argument assigned), a log line, a phrase repeated over,
    words about the call or the assistant; [] for plain English."""
    calls = list(_CALL.finditer(request))
    found = [match.group(0)[:60] for match in calls]
    found += [match.group(0) for match in _JSON_OBJECT.finditer(request)]
    found += [match.group(0) for match in _LOG_LINE.finditer(request)]
    found += [
        match.group(0)
        for match in _ASSIGNMENT.finditer(request)
        if not any(call.start() <= match.start() < call.end() for call in calls)
    ]
    found += [f"{match.group(1)!r} repeated" for match in _REPEATED.finditer(request)]
    found += [f"speaks of {match.group(0)!r}" for match in _ABOUT_THE_TASK.finditer(request)]
    names = list(functions)
    found += [
        name
        for name in names
        if is_identifier(name) and re.search(rf"\b{re.escape(name)}\b", request)
    ]
    asked = without_details(request)
    plain = [w for w in re.findall(r"[A-Za-z][a-z']*", asked) if w not in names]
    if len(plain) < MIN_PLAIN_WORDS:
        found.append(f"{len(plain)} plain words before its details")
    return list(dict.fromkeys(found))


# the abstractor's appended values: "... Details: receiver id 'USR005'." (capital D, as
# completion.py writes it; BFCL's users write "the following details:" in lower case)
_DETAILS_CLAUSE = re.compile(r"(?:^|(?<=\s))Details\s*:")
# a label before a colon that opens the request: "delete message: ...", "message_login: ..."
_OPENING_LABEL = re.compile(r"^\W*([A-Za-z_][A-Za-z0-9_ ]{0,60}?)\s*:")
# one "key value" item of an argument list: "receiver id 'USR005'", "amount 250",
# "unit: 'celsius'", "doors ['driver', 'passenger']"
_ITEM_VALUE = (
    r"(?:'[^']*'|\"[^\"]*\"|-?\d[\d,]*(?:\.\d+)?|True|False|None|true|false|null"
    r"|\[[^\[\]]*\]|\{[^{}]*\})"
)
_ARGUMENT_ITEM = re.compile(rf"^\s*([A-Za-z][A-Za-z0-9_ ]{{0,40}}?)\s*[:=]?\s*{_ITEM_VALUE}\s*$")
# a request that is a function's description copied: this share of its words lie in runs
# of at least COPIED_RUN words that also run, in order, through one tool's description
COPIED_RUN = 4
MIN_COPIED_SHARE = 0.75
MIN_COPIED_WORDS = 5
# one sentence of a longer request: BFCL's users quote a description's words in a
# sentence now and then ("Get the nearest airport to the given location"), never whole
MIN_SENTENCE_COPIED_SHARE = 0.95

# "Order type: Buy, Symbol: XYZ, Price: 150.0": a capitalised label, a colon, a value
# (a 0.5B abstractor's form, 2026-11-29), under this many different labels
_LABELLED_VALUES = re.compile(r"\b[A-Z][a-z]+(?: [a-z]+)?: ?[\w.$'\"-]+")
MIN_LABELLED_VALUES = 4

# where one sentence of a request ends and the next begins
_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+")


def _spoken(label: str) -> list[str]:
    """A label's words as :func:`name_words` splits a name: "Delete Message" and
    ``delete_message`` -> [delete, message]."""
    return [word for part in label.split() for word in name_words(part)]


def copied_share(request: str, description: str, run: int = COPIED_RUN) -> float:
    """The share of ``request``'s words that lie in a run of ``run`` or more consecutive
    words found, in the same order, in ``description`` (0.0 for an empty request)."""
    asked = _WORD.findall(request.lower())
    text = f" {' '.join(_WORD.findall(description.lower()))} "
    if not asked or len(text) < 3:
        return 0.0
    covered = [False] * len(asked)
    start = 0
    while start + run <= len(asked):
        end = start + run
        if f" {' '.join(asked[start:end])} " not in text:
            start += 1
            continue
        while end < len(asked) and f" {' '.join(asked[start : end + 1])} " in text:
            end += 1
        covered[start:end] = [True] * (end - start)
        start = end
    return sum(covered) / len(asked)


def argument_list(request: str, parameters: Iterable[str] = ()) -> bool:
    """Whether ``request`` is a list of arguments, not a sentence: "key value" items
    separated by ";" ("receiver id 'USR005'; message 'hi'."), two or more, or one whose
    key is a parameter's name in words."""
    items = [item for item in request.strip().rstrip(".").split(";") if item.strip()]
    matches = [_ARGUMENT_ITEM.match(item) for item in items]
    if not items or not all(matches):
        return False
    if len(items) >= 2:
        return True
    keys = {" ".join(name_words(parameter)) for parameter in parameters}
    return any(" ".join(_spoken(m.group(1))) in keys for m in matches if m is not None)


def template_request(
    request: str,
    functions: Iterable[str],
    descriptions: Iterable[str] = (),
    parameters: Iterable[str] = (),
) -> str | None:
    """Why ``request`` is a template filled from a function's documentation, not
    something a user says; None when it is not. A template is:

    - a "Details:" clause, the argument values code appends (``... Details: receiver id
      'USR005'.``);
    - a function's name in words (or as its identifier) opening the request before a
      colon: "delete message: Delete the latest message ...", "message login: User
      'USR002' logged in successfully.";
    - one of ``descriptions`` copied: ``MIN_COPIED_SHARE`` of the request's words (at least
      ``MIN_COPIED_WORDS``) in runs of ``COPIED_RUN`` words found in one description;
    - a list of arguments ("receiver id 'USR005'; message 'hi'"; :func:`argument_list`);
    - values under ``MIN_LABELLED_VALUES`` or more different labels ("Order type: Buy,
      Symbol: XYZ, Price: 150.0, Amount: 100"; BFCL's users write three at most);
    - a sentence of it that copies a description (``MIN_SENTENCE_COPIED_SHARE`` of
      its words, at least ``MIN_COPIED_WORDS``: "View all historical messages sent by
      the current user. Estimates the distance between two cities, ...").
    """
    descriptions = list(descriptions)  # read twice: the whole request, then each sentence
    details = _DETAILS_CLAUSE.search(request)
    if details is not None:
        return f"it carries a 'Details:' list of values: {request[details.start() :][:60]!r}"
    label = _OPENING_LABEL.match(request)
    if label is not None:
        spoken = _spoken(label.group(1))
        named = next((f for f in functions if spoken and name_words(f) == spoken), None)
        if named is not None:
            return f"it opens with the name of {named} and a colon: {label.group(0).strip()!r}"
    asked = _WORD.findall(request.lower())
    if len(asked) >= MIN_COPIED_WORDS:
        for description in descriptions:
            share = copied_share(request, description)
            if share >= MIN_COPIED_SHARE:
                return f"{share:.0%} of it is copied from a description: {description[:60]!r}"
    if argument_list(request, parameters):
        return f"it is a list of argument values: {request[:60]!r}"
    labelled = _LABELLED_VALUES.findall(request)
    if len({item.split(":")[0] for item in labelled}) >= MIN_LABELLED_VALUES:
        return f"it labels its values: {', '.join(labelled[:3])!r}"
    for sentence in _SENTENCE_END.split(request):
        if len(_WORD.findall(sentence.lower())) < MIN_COPIED_WORDS or sentence == request:
            continue
        for description in descriptions:
            share = copied_share(sentence, description)
            if share >= MIN_SENTENCE_COPIED_SHARE:
                return f"a sentence copies a description: {description[:60]!r}"
    return None


def other_function_named(request: str, called: Sequence[str], offered: Sequence[str]) -> str | None:
    """An offered function that is not called but whose name (two words or more, in
    words, articles allowed between them: "check tire pressure", "get the current speed")
    ``request`` says before its "Details:" clause; None otherwise. A request that names a
    function asks for it, whether or not it also names the one it calls ("get the current
    speed, then adjust the climate control"). Three of BFCL's 373 train-split base turns
    do this."""
    text = " ".join(_WORD.findall(without_details(request).lower()))

    def said(function: str) -> bool:
        words = name_words(function)
        spoken = _ARTICLES.join(re.escape(word) for word in words)
        return len(words) >= 2 and re.search(rf"\b{spoken}\b", text) is not None

    return next((name for name in offered if name not in called and said(name)), None)


def opposite_action(request: str, called: str, offered: Sequence[str]) -> str | None:
    """The opposite verb ``request`` uses for the call of ``called`` (it says "remove",
    never "add", for ``add_to_watchlist``, and the environment offers a function of the
    opposite action); None when the request does not ask for the opposite."""
    words = set(_WORD.findall(request.lower()))
    action = name_words(called)[:1]
    offered_actions = {name_words(name)[0] for name in offered if name_words(name)}
    for these, those in (*OPPOSITE_ACTIONS, *((b, a) for a, b in OPPOSITE_ACTIONS)):
        if not action or action[0] not in these or words & these:
            continue
        said = sorted(words & those)
        if said and offered_actions & those:
            return said[0]
    return None

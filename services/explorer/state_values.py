"""The values of an initial configuration a variant may change, their new values, and
the configuration and texts with them changed (``state_variation.py`` replays the turn).

Numbers (a balance, a fuel level, a price) are scaled into a plausible range around them,
within the bounds a BFCL class's module names, rounded as they were written. Identifiers
written alike (``USR001``, ``USR002``; order ids) are renamed together by one offset, so
their shape and their order hold (the most recent order keeps the largest id); others (a
uuid, a code) are drawn again character by character. A rename is made wherever the
configuration holds the identifier: keys, values, inside text.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
import string
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coevolve.shared.envs.bfcl.catalog import (
    UnavailableClassError,
    all_class_names,
    api_class,
    is_stateless,
)

Path = tuple[Any, ...]
Number = int | float

# a value written like an identifier: an order or card number, letters then digits
# (``USR005``), a long code of hex digits (a uuid) or of capitals and digits
ID_TEXT = re.compile(
    r"\d{4,}|[A-Za-z]{2,}[-_]?\d{2,}"
    r"|(?=[0-9a-fA-F-]*\d)[0-9a-fA-F]{8,}(?:-[0-9a-fA-F]{4,})*"
    r"|(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{8,}"
)
# a number held under such a key is an identifier (``account_id``, ``binding_card``, the
# next order's ``order_counter``), renamed rather than scaled
ID_KEY = re.compile(r"(?:^|_)(?:[Ii][Dd]|card|counter|number)$|[a-z](?:Id|Card|Number)$")
# counts of what the state holds and seeds: changing one alone makes the state inconsistent
NOT_VARIED_KEY = re.compile(r"(?:^|_)count$|seed", re.IGNORECASE)
PREFIXED_ID = re.compile(r"([A-Za-z]*[-_]?)(\d+)")
# a number is scaled by a factor from one of these ranges, rounded as it was written
FACTOR_RANGES = ((0.6, 0.9), (1.1, 1.4))


@dataclass(frozen=True)
class NumberKnob:
    """A number of the initial configuration, at ``path``."""

    path: Path
    old: Number


@dataclass(frozen=True)
class IdKnob:
    """Identifiers written alike (``USR001``, ``USR002``), renamed together so that their
    order (the most recent order id is the largest) holds."""

    ids: tuple[str, ...]


Knob = NumberKnob | IdKnob


@dataclass(frozen=True)
class Variation:
    """What a variant changes: numbers (path, old, new) and identifiers (old, new)."""

    numbers: tuple[tuple[Path, Number, Number], ...] = ()
    renames: tuple[tuple[str, str], ...] = ()

    def __add__(self, other: Variation) -> Variation:
        return Variation(self.numbers + other.numbers, self.renames + other.renames)


def is_id_text(text: str) -> bool:
    return ID_TEXT.fullmatch(text) is not None


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _id_key(key: Any) -> bool:
    return isinstance(key, str) and ID_KEY.search(key) is not None


def _id_leaves(node: Any, key: Any = None) -> Iterator[str]:
    if isinstance(node, Mapping):
        for child_key, child in node.items():
            if isinstance(child_key, str) and is_id_text(child_key):
                yield child_key
            yield from _id_leaves(child, child_key)
    elif isinstance(node, list):
        for item in node:
            yield from _id_leaves(item, key)
    elif isinstance(node, str) and is_id_text(node):
        yield node
    elif is_number(node) and isinstance(node, int) and node > 0 and _id_key(key):
        yield str(node)


def id_texts(config: Mapping[str, Any]) -> list[str]:
    """The identifiers of a configuration, in order of appearance, each once."""
    return list(dict.fromkeys(_id_leaves(config)))


def _group_key(text: str) -> tuple[str, int] | str:
    """Identifiers renamed together: the same prefix and digit count; any other alone."""
    match = PREFIXED_ID.fullmatch(text)
    return (match.group(1), len(match.group(2))) if match else text


def id_knobs(config: Mapping[str, Any]) -> list[IdKnob]:
    groups: dict[tuple[str, int] | str, list[str]] = {}
    for text in id_texts(config):
        groups.setdefault(_group_key(text), []).append(text)
    return [IdKnob(tuple(ids)) for ids in groups.values()]


def leaves(node: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, value) of every value that is neither an object nor a list."""
    if isinstance(node, Mapping):
        for key, child in node.items():
            yield from leaves(child, (*path, key))
    elif isinstance(node, list | tuple):
        for position, child in enumerate(node):
            yield from leaves(child, (*path, position))
    else:
        yield path, node


def number_knobs(config: Mapping[str, Any], ids: Sequence[str]) -> list[NumberKnob]:
    """The configuration's numbers that may be scaled: not 0, not an identifier, not a
    count of what the state holds."""
    found: list[NumberKnob] = []
    for path, value in leaves(config):
        key = next((step for step in reversed(path) if isinstance(step, str)), "")
        if not is_number(value) or value == 0 or str(value) in ids:
            continue
        if ID_KEY.search(key) or NOT_VARIED_KEY.search(key):
            continue
        found.append(NumberKnob(path, value))
    return found


def knobs_of(config: Mapping[str, Any]) -> list[Knob]:
    ids = id_texts(config)
    return [*number_knobs(config, ids), *id_knobs(config)]


# --------------------------------------------------------------------------- drawing


def rounded_like(value: float, like: Number) -> Number:
    """``value`` written as ``like`` is: an integer, a whole float, or its decimals."""
    if isinstance(like, int):
        return round(value)
    if like.is_integer():
        return float(round(value))
    text = repr(like)
    decimals = len(text.split(".")[1]) if "." in text and "e" not in text else 2
    return round(value, decimals)


def bounds_of(path: Path) -> tuple[float, float]:
    """The range the environment's code gives a number at ``path``: a BFCL class's module
    names some (``MAX_FUEL_LEVEL``, ``MIN_BATTERY_VOLTAGE``); else any number."""
    unbounded = (-math.inf, math.inf)
    if len(path) < 2 or path[0] not in all_class_names():
        return unbounded
    try:
        module = sys.modules[api_class(path[0]).__module__]
    except UnavailableClassError:
        return unbounded
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", str(path[-1])).upper()
    return getattr(module, f"MIN_{name}", -math.inf), getattr(module, f"MAX_{name}", math.inf)


def drawn_number(knob: NumberKnob, rng: random.Random) -> Number | None:
    """The knob's number scaled into a plausible range around it (and the one its
    environment allows), of its type; None when rounding gives it back."""
    low, high = rng.choice(FACTOR_RANGES)
    lowest, highest = bounds_of(knob.path)
    scaled = min(max(knob.old * rng.uniform(low, high), lowest), highest)
    new = rounded_like(scaled, knob.old)
    return new if new not in (knob.old, 0) and lowest <= new <= highest else None


def _shifted(ids: Sequence[str], rng: random.Random) -> list[str] | None:
    """Prefixed numbers all moved by one offset, as wide as they were."""
    parts = [PREFIXED_ID.fullmatch(text) for text in ids]
    if any(part is None for part in parts):
        return None
    prefixes = [part.group(1) for part in parts if part]
    numbers = [int(part.group(2)) for part in parts if part]
    width = max(len(part.group(2)) for part in parts if part)
    lowest = 10 ** (width - 1) if not prefixes[0] else 1
    low, high = lowest - min(numbers), 10**width - 1 - max(numbers)
    offsets = [offset for offset in (rng.randint(low, high) for _ in range(4)) if offset]
    if not offsets or low > high:
        return None
    return [f"{p}{n + offsets[0]:0{width}d}" for p, n in zip(prefixes, numbers, strict=True)]


def _redrawn(text: str, rng: random.Random) -> str:
    """Each digit and letter of ``text`` drawn again from its kind (hex letters stay hex)."""
    letters = {c.lower() for c in text if c.isalpha()}
    hex_only = letters <= set("abcdef")
    out: list[str] = []
    for position, char in enumerate(text):
        if char.isdigit():
            out.append(rng.choice(string.digits[1:] if position == 0 else string.digits))
        elif char.isalpha():
            pool = "abcdef" if hex_only else string.ascii_lowercase
            drawn = rng.choice(pool)
            out.append(drawn.upper() if char.isupper() else drawn)
        else:
            out.append(char)
    return "".join(out)


def drawn_ids(ids: Sequence[str], rng: random.Random, taken: set[str]) -> list[str] | None:
    """Other well-formed identifiers for ``ids``, none written elsewhere (``taken``)."""
    others = taken - set(ids)
    for _ in range(4):
        shifted = _shifted(ids, rng)
        new = shifted if shifted is not None else [_redrawn(text, rng) for text in ids]
        if not others & set(new) and len(set(new)) == len(new) and new != list(ids):
            return new
    return None


def drawn(knobs: Sequence[Knob], rng: random.Random, taken: set[str]) -> Variation | None:
    """New values for ``knobs``; None when one of them has none."""
    variation = Variation()
    for knob in knobs:
        if isinstance(knob, NumberKnob):
            number = drawn_number(knob, rng)
            if number is None:
                return None
            variation += Variation(numbers=((knob.path, knob.old, number),))
        else:
            new = drawn_ids(knob.ids, rng, taken)
            if new is None:
                return None
            variation += Variation(renames=tuple(zip(knob.ids, new, strict=True)))
    return variation


# --------------------------------------------------------------------------- rewriting


def number_forms(value: Number) -> list[str]:
    """How a text may write ``value``: ``10000.0`` also as ``10000`` and ``10,000``."""
    forms = [str(value)]
    if isinstance(value, int) or value.is_integer():
        whole = int(value)
        forms += [str(whole), f"{whole:,}"]
    return list(dict.fromkeys(forms))


def number_mention(form: str) -> re.Pattern[str]:
    """A number written as ``form``, not part of another one (``150`` in ``150.75``,
    ``000`` in ``10,000``)."""
    return re.compile(rf"(?<![\w.])(?<!\d,){re.escape(form)}(?![\w]|[.,]\d)")


def writes_number(text: str, value: Number) -> bool:
    return any(number_mention(form).search(text) for form in number_forms(value))


def with_number(text: str, old: Number, new: Number) -> str:
    """``text`` with each way it writes ``old`` written as ``new`` (whole if it was)."""
    for form in sorted(number_forms(old), key=len, reverse=True):
        whole = "." not in form and float(new).is_integer()
        written = (f"{int(new):,}" if "," in form else str(int(new))) if whole else str(new)
        text = number_mention(form).sub(written.replace("\\", "\\\\"), text)
    return text


def renamed_text(text: str, renames: Mapping[str, str]) -> str:
    """``text`` with every identifier of ``renames`` renamed, as a whole token, all at once."""
    if not renames:
        return text
    if text in renames:
        return renames[text]
    alternatives = "|".join(re.escape(old) for old in sorted(renames, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.])(?:{alternatives})(?![\w])")
    return pattern.sub(lambda match: renames[match.group(0)], text)


def _renamed(node: Any, renames: Mapping[str, str]) -> Any:
    if isinstance(node, Mapping):
        return {_renamed(key, renames): _renamed(value, renames) for key, value in node.items()}
    if isinstance(node, list):
        return [_renamed(item, renames) for item in node]
    if isinstance(node, str):
        return renamed_text(node, renames)
    if isinstance(node, int) and not isinstance(node, bool) and str(node) in renames:
        return int(renames[str(node)])
    return node


def varied_config(config: Mapping[str, Any], variation: Variation) -> dict[str, Any]:
    """``config`` with ``variation`` made: each number at its path, then every identifier
    renamed wherever it appears (keys, values, inside text)."""
    varied: dict[str, Any] = copy.deepcopy(dict(config))
    for path, _, new in variation.numbers:
        node: Any = varied
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = new
    return _renamed(varied, dict(variation.renames)) if variation.renames else varied


def default_state(class_name: str) -> dict[str, Any]:
    """What a BFCL class loads where its configuration says nothing (its module's
    ``DEFAULT_STATE``), the values JSON can hold; {} for another class."""
    if class_name not in all_class_names() or is_stateless(class_name):
        return {}
    try:
        defaults = getattr(sys.modules[api_class(class_name).__module__], "DEFAULT_STATE", {})
    except UnavailableClassError:
        return {}
    plain: dict[str, Any] = {}
    for key, value in dict(defaults).items():
        try:
            plain[key] = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            continue  # a set, an object: stays a default
    return plain

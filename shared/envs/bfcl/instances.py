"""One episode's own API instances, the function table it offers, and safe dispatch.

Unlike BFCL's executor (instances in module globals, calls run through ``eval``), each
episode gets fresh instances that share no mutable object with any other episode, and a
call reaches a method only as ``getattr(instance, documented_public_name)(**checked_args)``.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from coevolve.shared.envs.bfcl.catalog import (
    FunctionDoc,
    api_class,
    function_docs,
    is_stateless,
    public_method_names,
)
from coevolve.shared.envs.bfcl.validation import ValidatedCall

Instances = dict[str, Any]

# MathAPI sets process-wide precision (mpmath.mp.dps) before computing; calls of such
# classes run one at a time so concurrent episodes cannot change each other's precision.
PROCESS_STATE_CLASSES = frozenset({"MathAPI"})
_process_state_lock = threading.Lock()


def create_instances(
    involved_classes: Iterable[str], initial_state: Mapping[str, Any], long_context: bool
) -> Instances:
    """Fresh instances loaded from a deep copy of ``initial_state`` (BFCL's own loader)."""
    instances: Instances = {}
    for class_name in involved_classes:
        instance = api_class(class_name)()
        if not is_stateless(class_name):
            scenario = copy.deepcopy(dict(initial_state.get(class_name, {})))
            instance._load_scenario(scenario, long_context=long_context)
        # Some loaders link module-level data into the instance (the long-context credit
        # cards, for one); a deep copy makes sure no two episodes share a mutable object.
        instances[class_name] = copy.deepcopy(instance)
    return instances


def function_table(
    involved_classes: Iterable[str], hidden: Iterable[str] = ()
) -> dict[str, FunctionDoc]:
    """Functions offered to the agent; a later class wins a name clash, as in BFCL."""
    hidden_names = set(hidden)
    table: dict[str, FunctionDoc] = {}
    for class_name in involved_classes:
        for doc in function_docs(class_name):
            if doc.name not in hidden_names:
                table[doc.name] = doc
    return table


def public_state(instances: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A deep copy of every instance's public attributes (what BFCL's state checker reads)."""
    return {
        class_name: copy.deepcopy(
            {key: value for key, value in vars(instance).items() if not key.startswith("_")}
        )
        for class_name, instance in instances.items()
    }


def format_result(result: Any) -> str:
    """Render a method's return value the way BFCL's executor does."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


def reports_error(result: Any) -> bool:
    """BFCL's APIs report failures in their return value rather than by raising."""
    if isinstance(result, dict):
        return "error" in result
    if isinstance(result, str):
        return result.startswith("Error")
    if isinstance(result, list) and result and isinstance(result[0], str):
        return result[0].startswith("Error")
    return False


@dataclass(frozen=True)
class CallOutcome:
    """``ok``: the method ran and reported no error. ``observation``: BFCL-formatted text."""

    ok: bool
    observation: str


def dispatch(instances: Mapping[str, Any], call: ValidatedCall) -> CallOutcome:
    """Run a validated call on the episode's own instance of its class."""
    class_name = call.doc.class_name
    instance = instances.get(class_name)
    if instance is None or call.name not in public_method_names(class_name):
        return CallOutcome(False, f"Error: function '{call.name}' is not available here")
    method = getattr(instance, call.name)
    # A copy, so a method that stores an argument cannot alias the episode's record.
    arguments = copy.deepcopy(call.arguments)
    try:
        if class_name in PROCESS_STATE_CLASSES:
            with _process_state_lock:
                result = method(**arguments)
        else:
            result = method(**arguments)
    except Exception as exc:
        return CallOutcome(False, f"Error during execution: {exc}")
    return CallOutcome(not reports_error(result), format_result(result))

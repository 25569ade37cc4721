"""Every BFCL API class with its function docs; only documented public methods callable."""

from __future__ import annotations

import inspect

import pytest
from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

from coevolve.shared.envs.bfcl.catalog import (
    MULTI_TURN_CLASSES,
    UnavailableClassError,
    all_class_names,
    api_class,
    available_class_names,
    function_docs,
    public_method_names,
)
from coevolve.shared.envs.bfcl.tasks import MULTI_TURN_CATEGORIES, load_tasks

JSON_SCHEMA_TYPES = {"object", "number", "integer", "string", "boolean", "array"}


def test_catalog_covers_every_class_bfcl_maps() -> None:
    assert set(all_class_names()) == set(CLASS_FILE_PATH_MAPPING)


def test_multi_turn_categories_use_only_the_eight_multi_turn_classes() -> None:
    used = {
        name
        for category in MULTI_TURN_CATEGORIES
        for task in load_tasks(category)
        for name in task.env_config["involved_classes"]
    }
    assert used == set(MULTI_TURN_CLASSES)


@pytest.mark.parametrize("class_name", MULTI_TURN_CLASSES)
def test_docs_match_public_methods_and_signatures(class_name: str) -> None:
    _check_docs_match(class_name)


@pytest.mark.slow
def test_every_importable_class_has_matching_docs() -> None:
    # Importing BFCL's agentic classes pulls in heavy optional dependencies; one of them
    # (the vector memory) needs sentence-transformers and may not import at all.
    available = available_class_names()
    assert set(MULTI_TURN_CLASSES) <= set(available)
    for class_name in available:
        _check_docs_match(class_name)


def _check_docs_match(class_name: str) -> None:
    docs = function_docs(class_name)
    assert docs, class_name
    assert {d.name for d in docs} == set(public_method_names(class_name))
    cls = api_class(class_name)
    for doc in docs:
        assert not doc.name.startswith("_")
        parameters = [
            p for p in inspect.signature(getattr(cls, doc.name)).parameters if p != "self"
        ]
        assert set(parameters) == set(doc.properties), doc.name
        assert set(doc.required) <= set(doc.properties)


def _schema_types(schema: dict[str, object]) -> set[str]:
    found = {str(schema["type"])} if "type" in schema else set()
    for sub in dict(schema.get("properties", {})).values():  # type: ignore[call-overload]
        found |= _schema_types(sub)
    if isinstance(schema.get("items"), dict):
        found |= _schema_types(schema["items"])  # type: ignore[arg-type]
    return found


@pytest.mark.parametrize("class_name", MULTI_TURN_CLASSES)
def test_tool_schemas_are_openai_style_json_schema(class_name: str) -> None:
    for doc in function_docs(class_name):
        schema = doc.tool_schema()
        assert schema["type"] == "function"
        function = schema["function"]
        assert function["name"] == doc.name
        assert function["parameters"]["type"] == "object"
        assert _schema_types(function["parameters"]) <= JSON_SCHEMA_TYPES


def test_unknown_class_is_a_clear_error() -> None:
    with pytest.raises(UnavailableClassError, match="no API class"):
        api_class("NoSuchAPI")

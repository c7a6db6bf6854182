"""Request-body validation against the Compute Engine v1 discovery document.

The document is the one google-api-python-client ships, so the emulator accepts exactly the
fields the real API knows. Checks: unknown fields, JSON types, enum values, the `pattern`
of a property, and properties annotated as required for the method being called.
Wording follows the real API: decoding errors name the field in snake_case under the
request's body field (`instance_resource.can_ip_forward`), as Google's front end does.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from .errors import bad_payload, invalid_field_value, required_field

_SCALAR_TYPE_NAMES = {
    ("boolean", None): "TYPE_BOOL",
    ("string", None): "TYPE_STRING",
    ("string", "byte"): "TYPE_BYTES",
    ("string", "int64"): "TYPE_INT64",
    ("string", "uint64"): "TYPE_UINT64",
    ("integer", "int32"): "TYPE_INT32",
    ("integer", "uint32"): "TYPE_UINT32",
    ("number", "float"): "TYPE_FLOAT",
    ("number", "double"): "TYPE_DOUBLE",
}


def discovery_document_path() -> Path:
    import googleapiclient

    return Path(googleapiclient.__file__).parent / "discovery_cache/documents/compute.v1.json"


@lru_cache(maxsize=1)
def load_schemas() -> dict:
    return json.loads(discovery_document_path().read_text())["schemas"]


def snake(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


class BodyValidator:
    """Validates one request body for one API method (e.g. `compute.instances.insert`)."""

    def __init__(self, method_id: str, schemas: dict | None = None) -> None:
        self.method_id = method_id
        self.schemas = schemas if schemas is not None else load_schemas()

    def check(self, schema_name: str, body: object, body_field: str) -> None:
        """`body_field` is the proto name of the body (`instance_resource`)."""
        self._check_node({"$ref": schema_name}, body, body_field, "resource")

    def _check_node(self, node: dict, value: object, path: str, rpath: str) -> None:
        # JSON null means "not set" for every field of a proto message.
        if value is None:
            return
        if "$ref" in node:
            schema = self.schemas[node["$ref"]]
            self._check_object(schema, value, path, rpath, node["$ref"])
            return
        kind = node.get("type")
        if kind == "object":
            self._check_object(node, value, path, rpath, None)
        elif kind == "array":
            if not isinstance(value, list):
                raise bad_payload(
                    f"Invalid value at '{path}' (TYPE_LIST), {json.dumps(value)}", path
                )
            item = node.get("items", {})
            for i, element in enumerate(value):
                self._check_node(item, element, f"{path}[{i}]", f"{rpath}[{i}]")
        elif kind == "any" or kind is None:
            return
        else:
            self._check_scalar(node, value, path, rpath)

    def _check_object(
        self, schema: dict, value: object, path: str, rpath: str, type_name: str | None
    ) -> None:
        if not isinstance(value, dict):
            shown = f"type.googleapis.com/google.cloud.compute.v1.{type_name}" if type_name else "TYPE_MESSAGE"
            raise bad_payload(f"Invalid value at '{path}' ({shown}), {json.dumps(value)}", path)
        extra = schema.get("additionalProperties")
        props = schema.get("properties")
        if extra is not None and not props:
            # A map field (labels, ...): any key, values of one type.
            for key, element in value.items():
                self._check_node(extra, element, f"{path}[{key}]", f"{rpath}.{key}")
            return
        props = props or {}
        for key in value:
            if key not in props:
                raise bad_payload(
                    f'Invalid JSON payload received. Unknown name "{key}" at \'{path}\': '
                    "Cannot find field.",
                    path,
                )
        for key, prop in props.items():
            child_path, child_rpath = f"{path}.{snake(key)}", f"{rpath}.{key}"
            required = self.method_id in prop.get("annotations", {}).get("required", [])
            if value.get(key) is None:
                if required:
                    raise required_field(child_rpath)
                continue
            self._check_node(prop, value[key], child_path, child_rpath)

    def _check_scalar(self, node: dict, value: object, path: str, rpath: str) -> None:
        kind, fmt = node.get("type"), node.get("format")
        type_name = _SCALAR_TYPE_NAMES.get((kind, fmt), _SCALAR_TYPE_NAMES.get((kind, None), "TYPE_STRING"))
        if node.get("enum"):
            type_name = "TYPE_ENUM"
        ok = _scalar_ok(kind, fmt, value)
        if ok and node.get("enum") and value not in node["enum"]:
            ok = False
        if not ok:
            raise bad_payload(f"Invalid value at '{path}' ({type_name}), {json.dumps(value)}", path)
        pattern = node.get("pattern")
        if pattern and isinstance(value, str) and not re.fullmatch(pattern, value):
            raise invalid_field_value(rpath, value, f"Must be a match of regex '{pattern}'")


def _scalar_ok(kind: str | None, fmt: str | None, value: object) -> bool:
    # Proto JSON accepts 64-bit integers as strings or numbers, and 32-bit ones as
    # numbers or numeric strings; bools are never numbers.
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string" and fmt in ("int64", "uint64"):
        if isinstance(value, bool):
            return False
        if isinstance(value, int):
            return fmt == "int64" or value >= 0
        return isinstance(value, str) and re.fullmatch(r"-?\d+" if fmt == "int64" else r"\d+", value) is not None
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        if isinstance(value, bool):
            return False
        if isinstance(value, str):
            return re.fullmatch(r"-?\d+", value) is not None
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if kind == "number":
        if isinstance(value, bool):
            return False
        return isinstance(value, (int, float)) or (
            isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity")
        )
    return True

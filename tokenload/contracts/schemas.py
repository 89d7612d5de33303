"""JSON Schemas (draft 2020-12) generated from the contract types, and the files shipped beside them.

`python -m tokenload.contracts.schemas` writes `summary.schema.json` and `manifest.schema.json` into this
package; a test keeps the shipped files equal to what the types generate. Objects are closed
(`additionalProperties: false`): a key the writer adds without typing it fails validation.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

from tokenload.contracts.manifest import MANIFEST_VERSION, Manifest
from tokenload.contracts.summary import PATTERN_KEYS, SUMMARY_VERSION, Summary

DRAFT = "https://json-schema.org/draft/2020-12/schema"
# file name -> (root type, version, title)
SCHEMAS: dict[str, tuple[type, int, str]] = {
    "summary.schema.json": (Summary, SUMMARY_VERSION, "tokenload summary.json"),
    "manifest.schema.json": (Manifest, MANIFEST_VERSION, "tokenload manifest.json"),
}
_PLAIN: dict[Any, str] = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
_UNIONS = (Union, types.UnionType)


def json_schema(root: type, version: int, title: str) -> dict[str, Any]:
    """The JSON Schema of the TypedDict `root`, every nested TypedDict in `$defs`."""
    defs: dict[str, Any] = {}
    body = _Builder(defs).object(root)
    body.pop("description", None)
    return {"$schema": DRAFT, "title": title, "description": f"schema_version {version}", **body,
            "$defs": dict(sorted(defs.items()))}


class _Builder:
    def __init__(self, defs: dict[str, Any]) -> None:
        self.defs = defs

    def of(self, hint: Any) -> dict[str, Any]:
        """The schema of one type hint."""
        origin, args = get_origin(hint), get_args(hint)
        if hint is Any:
            return {}
        if hint in _PLAIN:
            return {"type": _PLAIN[hint]}
        if is_typeddict(hint):
            name = hint.__name__.lstrip("_")
            if name not in self.defs:
                self.defs[name] = {}  # a placeholder first: a type may contain itself
                self.defs[name] = self.object(hint)
            return {"$ref": f"#/$defs/{name}"}
        if origin is Literal:
            return {"const": args[0]} if len(args) == 1 else {"enum": list(args)}
        if origin in _UNIONS:
            return self._union(args)
        if origin is tuple:
            return {"type": "array", "prefixItems": [self.of(a) for a in args], "items": False}
        if origin in (list, Sequence):
            return {"type": "array", "items": self.of(args[0])}
        if origin in (dict, Mapping):
            return {"type": "object", "additionalProperties": self.of(args[1])}
        raise TypeError(f"no JSON Schema for {hint!r}")

    def _union(self, args: tuple[Any, ...]) -> dict[str, Any]:
        if all(a in _PLAIN for a in args):
            return {"type": [_PLAIN[a] for a in args]}
        nullable = type(None) in args
        rest = [self.of(a) for a in args if a is not type(None)]
        if nullable and len(rest) == 1 and "type" in rest[0] and isinstance(rest[0]["type"], str):
            return {**rest[0], "type": [rest[0]["type"], "null"]}
        if nullable and len(rest) == 1 and "enum" in rest[0]:
            return {"enum": [*rest[0]["enum"], None]}
        return {"anyOf": [*rest, *([{"type": "null"}] if nullable else [])]}

    def object(self, typed: Any) -> dict[str, Any]:
        hints = get_type_hints(typed)
        out: dict[str, Any] = {"type": "object"}
        doc = (typed.__doc__ or "").strip()
        if doc and not doc.startswith(f"{typed.__name__}("):  # a TypedDict without a docstring gets a generated one
            out["description"] = doc.split("\n\n")[0].replace("\n", " ")
        out["properties"] = {name: self.of(hint) for name, hint in hints.items()}
        required = [name for name in hints if name in typed.__required_keys__]
        if required:
            out["required"] = required
        patterns = {pattern: self.of(value) for owner, pattern, value in PATTERN_KEYS if owner is typed}
        if patterns:
            out["patternProperties"] = patterns
        out["additionalProperties"] = False
        return out


def generated() -> dict[str, str]:
    """File name -> the text of each schema file, as the types generate it."""
    return {name: json.dumps(json_schema(*spec), indent=2, ensure_ascii=False) + "\n"
            for name, spec in SCHEMAS.items()}


def shipped(name: str) -> dict[str, Any]:
    """A schema file as shipped in the package (`summary.schema.json`, `manifest.schema.json`)."""
    loaded: dict[str, Any] = json.loads((Path(__file__).parent / name).read_text(encoding="utf-8"))
    return loaded


def main() -> int:
    """Write the schema files into this package."""
    for name, text in generated().items():
        path = Path(__file__).parent / name
        path.write_text(text, encoding="utf-8")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

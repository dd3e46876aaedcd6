"""How a recipe key is declared (`key`): its default, its line in base.yml and the values it may
take. A leaf, as maxlite/schema.py is: the schema's modules (schema.py, schema_model.py,
schema_alignment.py) all declare their keys with it."""

# No `from __future__ import annotations` here: loading reads each field's type as a type (Field.type).
import dataclasses
from typing import Any

KINDS = ("path", "paths", "blend")  # values config.py resolves: a path, comma-separated paths, a data blend


def key(default: Any, doc: str, *, kind: str = "", section: str = "", choices: tuple = (),
        bounds: tuple[float | None, float | None] | None = None, positive: bool = False, model: bool = False) -> Any:
    """A key's default and its line in base.yml, and what its values may be (config_checks.validate
    refuses the rest in one line): one of `choices` (each item of a list), within inclusive `bounds`
    (low, high; None: unbounded), or `positive` (> 0). `kind` (KINDS) marks a value that names files;
    `section` opens a new section of base.yml, with this heading, at this key. `model`: the key is
    the model's (MODEL_KEYS)."""
    assert kind in ("", *KINDS), kind
    return dataclasses.field(default=default, metadata={
        "doc": doc, "kind": kind, "section": section, "choices": choices, "bounds": bounds, "positive": positive,
        "model": model})

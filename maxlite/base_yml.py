"""configs/base.yml, written from the schema (maxlite/schema.py): every key in its section, its default
as YAML reads it back, its one line of doc.

    python -m maxlite.base_yml            rewrite base.yml
    python -m maxlite.base_yml --check    exit 1 if it differs from the schema
"""

import json
import re
import sys
from typing import Any

import yaml

from maxlite import schema

_HEADER = """\
# maxlite base config: every key, its default, one line on what it does.
# Override with `python -m maxlite.train base.yml key=value ...` or a YAML that says `base_config: base.yml`.
# Precedence (low → high): this file, models/<model_name>.yml, your YAML, key=value on the command line.
# Written from maxlite/schema.py by `python -m maxlite.base_yml`: a key is declared (and changed) there.
"""
_PLAIN = re.compile(r"[A-Za-z_][\w.-]*")  # a list item written unquoted (when YAML reads it back as itself)


def yaml_value(value: Any) -> str:
    """A default as base.yml writes it: what yaml.safe_load reads back to the same value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value and abs(value) < 1e-3:
        # YAML 1.1 reads 1e-05 as a string: write the mantissa with a point (1.0e-05)
        digits = next(p for p in range(1, 18) if float(f"{value:.{p}e}") == value)
        return f"{value:.{digits}e}"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        items = [x if isinstance(x, str) and _PLAIN.fullmatch(x) and yaml.safe_load(x) == x
                 else yaml_value(x) for x in value]
        return "[" + ", ".join(items) + "]"
    return json.dumps(value, ensure_ascii=False)


def render() -> str:
    """base.yml's text: the header, then each section's keys with their default and doc."""
    out = [_HEADER]
    for name, f in schema.FIELDS.items():
        if f.metadata["section"]:
            out.append(f"\n# ---- {f.metadata['section']} ----\n")
        line = f"{name}: {yaml_value(f.default)}"
        out.append(f"{line.ljust(max(34, len(line) + 2))}# {f.metadata['doc']}\n")
    return "".join(out)


def main(argv: list[str]) -> int:
    """`python -m maxlite.base_yml`: rewrite base.yml from the schema; `--check`: exit 1 if it differs."""
    text = render()
    if "--check" in argv:
        same = schema.BASE_YML.read_text() == text
        print(f"{schema.BASE_YML}: {'up to date' if same else 'differs from maxlite/schema.py: run python -m maxlite.base_yml'}")
        return 0 if same else 1
    schema.BASE_YML.write_text(text)
    print(f"wrote {schema.BASE_YML} ({len(schema.FIELDS)} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m maxlite.checkpoints list PATH`: every step, complete or not, with NeMo-like names."""

from __future__ import annotations

import sys
from typing import Any

from maxlite import cli, config as C
from maxlite.checkpoints.layout import TMP_STEP, complete_steps, read_meta
from maxlite.checkpoints.storage import fs_of, storage_error


def checkpoint_name(meta: dict[str, Any], step: int) -> str:
    """NeMo-like: step=50000-consumed_samples=25600000-val_loss=1.76."""
    name = f"step={step}-consumed_samples={meta.get('consumed_samples', '?')}"
    if meta.get("val_loss") is not None:
        name += f"-val_loss={meta['val_loss']:.2f}"
    return name


def list_checkpoints(path: str) -> list[dict[str, Any]]:
    path = C.resolve_path(path).rstrip("/")
    fs = fs_of(path)
    if not fs.exists(path):
        raise C.ConfigError(f"{path}: no such checkpoint directory")
    complete = set(complete_steps(path))
    rows = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        tmp = TMP_STEP.match(name)
        if not (name.isdigit() or tmp):
            continue
        step = int(tmp.group(1) if tmp else name)
        ok = bool(not tmp and step in complete)
        meta = read_meta(path, step) if ok else {}
        rows.append({"step": step, "name": checkpoint_name(meta, step), "dir": name,
                     "bytes": fs.du(entry), "complete": ok, **{k: meta.get(k) for k in
                     ("consumed_samples", "tokens_seen", "val_loss")}})
    return sorted(rows, key=lambda r: (r["step"], r["complete"]))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@cli.entry_point()
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "list":
        print("usage: python -m maxlite.checkpoints list PATH   (a checkpoint dir, local or gs://)",
              file=sys.stderr)
        return 2
    try:
        rows = list_checkpoints(argv[1])
    except C.ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 — the storage's own error, as one line
        raise storage_error(argv[1], e) from None
    if not rows:
        print(f"no checkpoints in {argv[1]}")
    for r in rows:
        state = "complete" if r["complete"] else "INCOMPLETE (ignored; removed at the next start)"
        print(f"{r['name']:<56} {_human(r['bytes']):>11}  {state}  [{r['dir']}]")
    return 0


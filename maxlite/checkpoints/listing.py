"""`python -m maxlite.checkpoints list PATH`: every step, complete or not (or found corrupt, or kept
aside), with NeMo-like names; `verify PATH [STEP]` (verify.py) checks steps against their
checksums; `remove-corrupt PATH` deletes the steps a resume kept aside."""

from __future__ import annotations

import sys
from typing import Any

from maxlite import cli, config as C
from maxlite.checkpoints import checksums
from maxlite.checkpoints.layout import ASIDE_STEP, TMP_STEP, aside_steps, read_meta
from maxlite.checkpoints.storage import complete_steps, fs_of, storage_error


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
        tmp, aside = TMP_STEP.match(name), ASIDE_STEP.match(name)
        if not (name.isdigit() or tmp or aside):
            continue
        step = int(tmp.group(1) if tmp else aside.group(1) if aside else name)
        if aside:  # renamed by a resume that found it corrupt: kept, never restored
            rows.append({"step": step, "name": name, "dir": name, "bytes": fs.du(entry), "complete": False,
                         "corrupt": checksums.marker(path, name), "aside": True, "checksums": False})
            continue
        ok = bool(not tmp and step in complete)
        corrupt = checksums.marker(path, step) if ok else None
        try:
            meta = read_meta(path, step) if ok else {}
        except ValueError:  # a damaged meta item
            meta = {}
        rows.append({"step": step, "name": checkpoint_name(meta, step), "dir": name,
                     "bytes": fs.du(entry), "complete": ok, "corrupt": corrupt,
                     "checksums": ok and fs.exists(f"{entry}/{checksums.ITEM}"),
                     **{k: meta.get(k) for k in ("consumed_samples", "tokens_seen", "val_loss")}})
    return sorted(rows, key=lambda r: (r["step"], r["complete"]))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _state(r: dict[str, Any]) -> str:
    if r.get("aside"):
        return "KEPT ASIDE (found corrupt on resume, never restored; remove-corrupt deletes it)"
    if not r["complete"]:
        return "INCOMPLETE (ignored; removed at the next start)"
    if r["corrupt"] is not None:
        damaged = r["corrupt"].get("damaged") or []
        names = ", ".join(damaged[:4]) + (f" and {len(damaged) - 4} more" if len(damaged) > 4 else "")
        return f"CORRUPT (never restored: {names or r['corrupt'].get('detail', '')})"
    return "complete" if r["checksums"] else "complete (no checksums: written before them)"


def _parser():
    import argparse

    p = argparse.ArgumentParser(prog="python -m maxlite.checkpoints",
                                description="List a run's checkpoints, or verify them against their checksums.")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="every step, complete or not (or found corrupt), with NeMo-like names")
    ls.add_argument("path", help="a checkpoint directory, local or gs:// (e.g. runs/NAME/checkpoints)")
    ver = sub.add_parser("verify", help="check every array against its checksums; exit 1 when any step is corrupt")
    ver.add_argument("path", help="a checkpoint directory, local or gs://")
    ver.add_argument("step", nargs="?", type=int, help="one step (default: every step)")
    rm = sub.add_parser("remove-corrupt", help="delete the steps kept aside as corrupt (listed as KEPT ASIDE)")
    rm.add_argument("path", help="a checkpoint directory, local or gs://")
    return p


@cli.entry_point()
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "verify":
            return _verify(args.path, args.step)
        if args.command == "remove-corrupt":
            return _remove_corrupt(C.resolve_path(args.path).rstrip("/"))
        rows = list_checkpoints(args.path)
    except C.ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 — the storage's own error, as one line
        raise storage_error(args.path, e) from None
    if not rows:
        print(f"no checkpoints in {args.path}")
    for r in rows:
        print(f"{r['name']:<56} {_human(r['bytes']):>11}  {_state(r)}  [{r['dir']}]")
    return 0


def _remove_corrupt(path: str) -> int:
    fs = fs_of(path)
    names = aside_steps(path)
    for name in names:
        fs.rm(f"{path}/{name}", recursive=True)
        print(f"removed {path}/{name}")
    if not names:
        print(f"no steps kept aside in {path}")
    return 0


def _verify(path: str, step: int | None) -> int:
    """One line per step; exit 1 when any step is corrupt."""
    from maxlite.checkpoints import verify

    results = verify.run(path, step)
    for r in results:
        if not r["verified"]:
            print(f"step {r['step']}: not verified (written before checksums)")
        elif r["damaged"]:
            what = "; ".join(f"{name} ({why})" for name, why in sorted(r["damaged"].items()))
            print(f"step {r['step']}: CORRUPT: {what}")
        else:
            print(f"step {r['step']}: intact ({r['arrays']} arrays, {_human(r['bytes'])} checked in "
                  f"{r['seconds']:.1f} s)")
    return 1 if any(r["damaged"] for r in results) else 0


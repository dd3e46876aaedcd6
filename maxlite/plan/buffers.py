"""What holds a plan's memory: the largest buffers of the compiled step, read from the compiler's own
buffer assignment (XLA's memory-usage report), for a plan that fits and for one that does not.

libtpu's out-of-memory error gives one total ("the total memory required for HLO temporaries (62.41G)
exceeds available HBM"), which does not say what to change. XLA writes its buffer assignment when
asked to dump a compilation, also one that runs out of memory; `compiler_options(dir)` asks for it for
the one step the planner compiles (per compilation, not through XLA_FLAGS), and `largest(dir)` reads
its report: the default memory space's allocations by size, each with the shapes of the values that
share it over the program (`5×bf16[16,8,8192,8192]`: five values of that shape at different times).
"""

from __future__ import annotations

import pathlib
import re

SHOWN = 8  # allocations in the report's table and the plan's JSON
_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_ROW = re.compile(r"^\s*[\d.]+[KMGT]?i?B\(\s*\d+%\);\s*([\d.]+)([KMGT]?i?B);\s*\d+;\s*(\d+);\s*(.+)$")


def compiler_options(dump_dir: str, text: bool = False) -> dict:
    """Options for `Lowered.compile`: XLA's dump of this compilation (its buffer assignment) in dump_dir;
    with `text`, also the program before and after optimization as HLO text (`--dump-hlo`)."""
    return {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": text}


def parse(report: str) -> list[dict]:
    """The default memory space's rows of a memory-usage report, largest first: {bytes, values, shapes}."""
    rows = []
    for line in report.split("Memory Space:")[1].splitlines() if "Memory Space:" in report else []:
        if line.strip().startswith("The rest"):
            break
        m = _ROW.match(line)
        if m:
            size, unit, values, shapes = m.groups()
            rows.append({"bytes": int(float(size) * _UNIT[unit]), "values": int(values), "shapes": shapes.strip()})
    return sorted(rows, key=lambda r: -r["bytes"])


def largest(dump_dir: str, module: str = "train_step") -> list[dict]:
    """The SHOWN largest allocations of the dumped `module`'s report ([] when there is none)."""
    reports = sorted(pathlib.Path(dump_dir).glob(f"*{module}*memory-usage-report.txt"))
    return parse(reports[-1].read_text())[:SHOWN] if reports else []

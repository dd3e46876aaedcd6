"""Collectives in a compiled HLO module, by kind: how many run per step and how many bytes they carry.

Ops inside a while loop (the scan over layers, gradient accumulation) run once per iteration: the
trip count is read from the loop condition (`compare(i, constant(N)), direction=LT`), so a per-layer
all-gather counts L times, unlike XLA's cost analysis, which counts a loop body once.

Where the compiler states how an op runs on the torus (Ironwood's SparseCore-offloaded all-reduces
name their `ring_dim`s in the backend config: X, Y and Z rings in both directions at once), the op's
bytes are spread over that many rings (`ring_moved`); an op that states nothing (the TensorCore
collectives of v5p and v6e) is counted on one ring. An op the compiler offloads to the SparseCores
(`"device_type":"DEVICE_TYPE_SPARSECORE"`) is counted apart as well (`offloaded_ring_moved`): it runs
beside the TensorCores' work, not in it (maxlite/plan/estimate.py).

A ragged all-to-all (the dropless expert exchange, maxlite/models/moe_parallel.py) moves a number of
rows known only at run time, into an output buffer sized for the worst case (every sender's rows
for one device). It is counted at the balanced routing's volume: min(input, output buffer) bytes —
a device's own rows on the way out, what it received on the way back — of which (n − 1)/n leave
the device. Its operands are named, not shaped, in compiled text: their sizes are read from the
instructions that define them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from functools import lru_cache

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(")
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (" + "|".join(KINDS) + r")(-start)?\(")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w-]*)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r"s32\[\]\S* constant\((\d+)\)")
_MESH_GROUP = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")
_LIST_GROUP = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUP = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_RING_DIM = re.compile(r'"ring_dim":"(\w+)"')
_SPARSECORE = '"device_type":"DEVICE_TYPE_SPARSECORE"'


@dataclasses.dataclass
class Collective:
    kind: str
    count: int = 0            # executions per step (loop bodies multiplied by their trip count)
    static: int = 0           # occurrences in the program text
    bytes: float = 0.0        # result bytes per device, summed over executions
    moved: float = 0.0        # bytes each device sends (ring algorithms), summed over executions
    ring_moved: float = 0.0   # the same, each op's divided by the torus rings it runs on at once (its
                              # backend config's ring dims; 1 where it names none): what one ring carries
    offloaded_ring_moved: float = 0.0  # the part of ring_moved of ops offloaded to the SparseCores

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _shape_bytes(text: str) -> list[float]:
    out = []
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _DTYPE_BYTES:
            out.append(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype])
    return out


def _group_size(line: str) -> int:
    m = _MESH_GROUP.search(line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)) if a in sizes)
    m = _LIST_GROUP.search(line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = _IOTA_GROUP.search(line)
    if m:
        return int(m.group(1).split(",")[-1])
    return 1


def _moved(kind: str, nbytes: float, n: int) -> float:
    """Bytes one device sends for a result of nbytes in a group of n (ring algorithms)."""
    if kind == "collective-permute":
        return nbytes  # point to point: no replica groups
    if n <= 1:
        return 0.0
    if kind == "all-gather":
        return nbytes * (n - 1) / n
    if kind == "all-reduce":
        return 2 * nbytes * (n - 1) / n
    if kind == "reduce-scatter":
        return nbytes * (n - 1)  # the result is 1/n of the input
    return nbytes * (n - 1) / n  # all-to-all, ragged or not: all but one's own share leaves


def rings(line: str) -> int:
    """How many torus dimensions' rings a collective runs on at once: the distinct `ring_dim`s its
    backend config names (Ironwood's offloaded all-reduces: X, Y and Z), else 1."""
    return max(1, len(set(_RING_DIM.findall(line))))


def _split(text: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            name = header.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = comps[name]
                comps["__entry_name__"] = [name]
        elif name is not None:
            comps[name].append(line)
    return comps


def _runs(comps: dict[str, list[str]]):
    """name → executions per step (entry 1; a while body × its trip count; nested loops multiply)."""
    entry = comps.get("__entry_name__", [None])[0]
    callers: dict[str, list[tuple[str, int]]] = defaultdict(list)  # callee → [(caller, factor)]
    for name, lines in comps.items():
        if name.startswith("__"):
            continue
        for line in lines:
            calls = dict(_CALLS.findall(line))
            trips = 1
            if "body" in calls and "condition" in calls:
                m = _TRIP.search("\n".join(comps.get(calls["condition"], [])))
                trips = int(m.group(1)) if m else 1
            for key, callee in calls.items():
                callers[callee].append((name, trips if key == "body" else 1))
            for branch in _BRANCHES.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", branch):
                    callers[callee].append((name, 1))

    @lru_cache(maxsize=None)
    def runs(name: str, depth: int = 0) -> int:
        if name == entry:
            return 1
        if depth > 64:
            return 0
        return sum(runs(caller, depth + 1) * factor for caller, factor in callers.get(name, ()))

    return runs


def collectives(text: str) -> dict[str, Collective]:
    """{kind: Collective} for an HLO module's text (compiled.as_text())."""
    comps = _split(text)
    runs = _runs(comps)
    out = {kind: Collective(kind) for kind in KINDS}
    for name, lines in comps.items():
        if name.startswith("__"):
            continue
        n_runs, sizes = None, {}
        for line in lines:
            instr = _INSTR.match(line)
            if instr:
                sizes[instr.group(1)] = sum(_shape_bytes(instr.group(2)))
            m = _OP.match(line)
            if not m:
                continue
            n_runs = runs(name) if n_runs is None else n_runs
            kind, shapes = m.group(2), _shape_bytes(m.group(1))
            nbytes = (max(shapes) if m.group(3) else sum(shapes)) if shapes else 0.0
            if kind == "ragged-all-to-all":  # (input, output buffer, offsets and sizes...)
                operands = re.findall(r"%([\w.\-]+)", instr.group(4))[:2]
                nbytes = min([sizes[o] for o in operands if o in sizes] + [nbytes])
            c = out[kind]
            c.static += 1
            c.count += n_runs
            c.bytes += nbytes * n_runs
            moved = _moved(kind, nbytes, _group_size(line)) * n_runs
            c.moved += moved
            c.ring_moved += moved / rings(line)
            if _SPARSECORE in line:
                c.offloaded_ring_moved += moved / rings(line)
    return out


_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional",
         "call", "after-all", "partition-id", "replica-id", "opt-barrier", "copy-done",
         "add-dependency"}


_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def custom_calls(text: str) -> dict[str, int]:
    """{custom-call target: executions per step} (e.g. tpu_custom_call: the Pallas kernels)."""
    comps = _split(text)
    runs = _runs(comps)
    out: dict[str, int] = defaultdict(int)
    for name, lines in comps.items():
        if name.startswith("__"):
            continue
        for line in lines:
            m = _INSTR.match(line)
            if m and m.group(3) == "custom-call":
                target = _TARGET.search(line)
                out[target.group(1) if target else "?"] += runs(name)
    return dict(out)


def _loop_trips(comps) -> dict[str, int]:
    trips = {}
    for lines in comps.values():
        for line in lines:
            calls = dict(_CALLS.findall(line))
            if "body" in calls and "condition" in calls:
                m = _TRIP.search("\n".join(comps.get(calls["condition"], [])))
                trips[calls["body"]] = int(m.group(1)) if m else 1
    return trips


def _sliced_bytes(shape_text: str, trips: int) -> float:
    """Bytes an op touches per iteration: a stacked per-layer buffer ([trips, ...], carried by the
    scan) is read or updated one slice at a time."""
    total = 0.0
    for dtype, dims in _SHAPE.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        dims = [int(d) for d in dims.split(",") if d]
        nbytes = math.prod(dims) * _DTYPE_BYTES[dtype]
        total += nbytes / trips if trips > 1 and dims and dims[0] == trips else nbytes
    return total


def hbm_bytes(text: str) -> float:
    """Bytes read and written per step by the top-level ops (each fusion reads its operands and
    writes its result), loops multiplied by their trip counts; an approximation of HBM traffic.
    A custom call (a Pallas kernel such as splash attention) is one such op: Q, K, V in, O out.
    A ragged all-to-all reads the rows it sends and writes those it receives, not its whole output
    buffer (sized for the worst case): it counts twice a balanced routing's rows."""
    comps = _split(text)
    runs, trips = _runs(comps), _loop_trips(comps)
    control = {comps["__entry_name__"][0]} if "__entry_name__" in comps else set()
    control |= set(trips)
    for lines in comps.values():
        for line in lines:
            for key, callee in _CALLS.findall(line):
                if key in ("true_computation", "false_computation"):
                    control.add(callee)
            for branch in _BRANCHES.findall(line):
                control.update(re.findall(r"%?([\w.\-]+)", branch))
    total = 0.0
    for name in control:
        n = trips.get(name, 1)
        sizes: dict[str, float] = {}
        subtotal = 0.0
        for line in comps.get(name, ()):
            m = _INSTR.match(line)
            if not m:
                continue
            result = _sliced_bytes(m.group(2), n)
            sizes[m.group(1)] = result
            op = m.group(3)
            if op in _FREE or op.endswith("-done"):
                continue
            operands = re.findall(r"%([\w.\-]+)", m.group(4).split("), ")[0])
            if op == "ragged-all-to-all":  # reads the rows it sends, writes those it receives into its
                # (aliased, worst-case) output buffer: at a balanced routing's volume, as `collectives`
                subtotal += 2 * min([sizes[o] for o in operands[:2] if o in sizes] + [result])
                continue
            subtotal += result + sum(sizes.get(o, 0.0) for o in operands)
        total += subtotal * runs(name)
    return total

"""Checkpointless recovery: in-memory snapshots of each host's shard of the train state.

Taking one (every `inmemory_snapshot_period` steps) does not stall the loop: a jitted copy of the
state (the loop donates the original to the next step) plus a ring shift of every device's block
to the same-position device of the next host (the peer replica) are *queued* behind the step; a
background thread then fetches this host's blocks to host memory and hands both blobs to the
keeper. (Only when the previous write has not ended by the next snapshot does the loop wait for it.)
Restoring picks the newest step complete across all hosts — from each host's own shard,
or, for a lost host, from the replica its successor holds (sent back by the inverse ring shift) —
and rebuilds the sharded arrays with `jax.make_array_from_single_device_arrays`.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_BYTES = 1 << 16  # room for one process's data-iterator state (JSON) in the snapshot


# ---- blobs: one host's blocks, self-describing ----

def _index_key(index: tuple, shape: tuple) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def pack(step: int, leaves: list[tuple[str, np.dtype, tuple, list[tuple[tuple, np.ndarray]]]]) -> bytes:
    header, chunks, offset = {"step": step, "leaves": []}, [], 0
    for path, dtype, shape, blocks in leaves:
        entry = {"path": path, "dtype": np.dtype(dtype).str, "shape": list(shape), "blocks": []}
        for index, data in blocks:
            data = np.ascontiguousarray(data)
            entry["blocks"].append({"index": [list(i) for i in index], "offset": offset, "nbytes": data.nbytes})
            chunks.append(memoryview(data).cast("B"))
            offset += data.nbytes
        header["leaves"].append(entry)
    head = json.dumps(header).encode()
    return b"".join([struct.pack("<Q", len(head)), head, *chunks])


def unpack(blob) -> tuple[int, dict[str, dict[tuple, np.ndarray]]]:
    blob = memoryview(blob)
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(bytes(blob[8:8 + n]))
    base, out = 8 + n, {}
    for leaf in header["leaves"]:
        dtype = np.dtype(leaf["dtype"])
        out[leaf["path"]] = {
            tuple(tuple(i) for i in b["index"]):
                np.frombuffer(blob[base + b["offset"]: base + b["offset"] + b["nbytes"]], dtype).reshape(
                    [stop - start for start, stop in b["index"]])
            for b in leaf["blocks"]}
    return header["step"], out


# ---- the ring of hosts ----

def ring_perm(mesh: Mesh, shift: int = 1) -> list[tuple[int, int]]:
    """(source, target) flat device positions: each device → same local rank on process p+shift."""
    flat = list(mesh.devices.flat)
    procs = sorted({d.process_index for d in flat})
    by_proc = {p: [i for i, d in enumerate(flat) if d.process_index == p] for p in procs}
    if len({len(v) for v in by_proc.values()}) != 1:
        raise ValueError("in-memory snapshots need the same number of devices on every host")
    nxt = {p: procs[(k + shift) % len(procs)] for k, p in enumerate(procs)}
    return [(i, by_proc[nxt[d.process_index]][by_proc[d.process_index].index(i)]) for i, d in enumerate(flat)]


def _spec(s: NamedSharding) -> P:
    return s.spec


def _data_state_array(mesh: Mesh, data_state: dict | None) -> jax.Array:
    raw = json.dumps(data_state).encode()
    if len(raw) > DATA_BYTES - 4:
        raise ValueError(f"data-iterator state is {len(raw)} bytes; snapshots hold at most {DATA_BYTES - 4}")
    row = np.zeros((1, DATA_BYTES), np.uint8)
    row[0, :4] = np.frombuffer(struct.pack("<I", len(raw)), np.uint8)
    row[0, 4:4 + len(raw)] = np.frombuffer(raw, np.uint8)
    n_local = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    return jax.make_array_from_process_local_data(sharding, np.repeat(row, n_local, axis=0))


def _decode_data_state(block: np.ndarray) -> Any:
    (n,) = struct.unpack("<I", bytes(block.reshape(-1)[:4]))
    return json.loads(bytes(block.reshape(-1)[4:4 + n]))


class Snapshots:
    """Takes snapshots of (state, data state) and restores the newest complete one."""

    def __init__(self, mesh: Mesh, shardings, keeper, *, period: int, max_bytes: int, faults=None, log=print):
        self.mesh, self.keeper, self.period, self.max_bytes = mesh, keeper, period, max_bytes
        self.faults, self.log = faults, log
        self.rank, self.num = jax.process_index(), jax.process_count()
        # snapshots of another topology (process count, mesh shape) are invisible, not misread
        tag = f"p{self.num}m{'x'.join(str(n) for n in mesh.devices.shape)}"
        self.own_kind, self.peer_kind = f"own-{tag}", f"peer-{tag}"
        self.data_sharding = NamedSharding(mesh, P(mesh.axis_names))
        self.tree_shardings = (shardings, self.data_sharding)
        specs = jax.tree.map(_spec, self.tree_shardings)
        self._copy = jax.jit(lambda t: jax.tree.map(lambda x: x.copy(), t),
                             out_shardings=self.tree_shardings)
        self._perm = ring_perm(mesh, 1) if self.num > 1 else []
        inverse = [(t, s) for s, t in self._perm]
        names = mesh.axis_names

        def shifter(perm):
            body = lambda t: jax.tree.map(lambda x: jax.lax.ppermute(x, names, perm), t)  # noqa: E731
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False))

        self._to_peer = shifter(self._perm) if self.num > 1 else None
        self._from_peer = shifter(inverse) if self.num > 1 else None
        self._thread: threading.Thread | None = None
        self.taken: list[int] = []  # steps kept, oldest first
        self.bytes_per_snapshot = 0
        self.disabled = False
        self.last_seconds = 0.0
        self.cpu_seconds = 0.0  # CPU time of the background writes, all snapshots
        self.stalls = 0  # snapshots that waited for the previous one's write

    # ---- taking ----
    def due(self, step: int) -> bool:
        return self.period > 0 and step % self.period == 0 and not self.disabled

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def take(self, step: int, state, data_state) -> None:
        """Queue the snapshot of `state` (the state after `step` steps). If the previous one is still
        being written, wait for it first: every host must take the same snapshots, since each one
        queues a collective (the ring shift) in the same order on all of them; a host that skipped
        one while its peer did not would pair that shift with the peer's next training collective."""
        if self.busy():
            self.stalls += 1
            self.wait()
        tree = (state, _data_state_array(self.mesh, data_state))
        own = self._copy(tree)  # queued behind the step; the loop may donate `state` now
        peer = self._to_peer(own) if self._to_peer is not None else None
        for leaf in jax.tree.leaves((own, peer)):
            leaf.copy_to_host_async()
        self._thread = threading.Thread(target=self._write, args=(step, own, peer), name="maxlite-snapshot",
                                        daemon=True)
        self._thread.start()

    def _blocks(self, tree, source_of=None):
        """This host's distinct blocks of every leaf; `source_of` maps a device to the device whose block it holds."""
        leaves = []
        flat = list(self.mesh.devices.flat)
        pos = {d: i for i, d in enumerate(flat)}
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            indices = leaf.sharding.devices_indices_map(leaf.shape)
            blocks = {}
            for shard in leaf.addressable_shards:
                device = shard.device if source_of is None else flat[source_of[pos[shard.device]]]
                key = _index_key(indices[device], leaf.shape)
                if key not in blocks:
                    blocks[key] = np.asarray(shard.data)
            leaves.append((jax.tree_util.keystr(path), leaf.dtype, leaf.shape, list(blocks.items())))
        return leaves

    def _write(self, step: int, own, peer) -> None:
        try:
            started, cpu = time.perf_counter(), time.thread_time()
            own_blob = pack(step, self._blocks(own))
            peer_blob = None
            if peer is not None:
                source_of = {t: s for s, t in self._perm}
                peer_blob = pack(step, self._blocks(peer, source_of))
            del own, peer
            size = len(own_blob) + (len(peer_blob) if peer_blob is not None else 0)
            self.bytes_per_snapshot = size
            if 2 * size > self.max_bytes:  # room for the newest and one complete older one
                self.disabled = True
                self.log(f"maxlite: in-memory snapshots off: one needs {size / 2**20:.1f} MiB per host, "
                         f"inmemory_snapshot_max_bytes allows {self.max_bytes / 2**20:.1f} MiB for two")
                return
            while self.taken and (len(self.taken) + 1) * size > self.max_bytes:
                self._drop(self.taken.pop(0))
            if self.faults is not None:
                self.faults.in_snapshot(step)
            self.keeper.put(step, self.own_kind, self.rank, own_blob)
            if peer_blob is not None:
                self.keeper.put(step, self.peer_kind, (self.rank - 1) % self.num, peer_blob)
            self.taken.append(step)
            self.last_seconds = time.perf_counter() - started
            self.cpu_seconds += time.thread_time() - cpu  # competes with training on CPU hosts
        except Exception as e:  # noqa: BLE001 — a failed snapshot must not kill training
            self.log(f"maxlite: in-memory snapshot of step {step} failed: {type(e).__name__}: {e}")

    def _drop(self, step: int) -> None:
        self.keeper.drop(step, self.own_kind, self.rank)
        if self.num > 1:
            self.keeper.drop(step, self.peer_kind, (self.rank - 1) % self.num)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    # ---- restoring ----
    def drop_after(self, step: int) -> None:
        """Forget the snapshots of steps after `step` (a rolled-back run's bad states)."""
        self.wait()
        for s in self.keeper.steps(self.own_kind, self.rank):
            if s > step:
                self.keeper.drop(s, self.own_kind, self.rank)
        if self.num > 1:
            for s in self.keeper.steps(self.peer_kind, (self.rank - 1) % self.num):
                if s > step:
                    self.keeper.drop(s, self.peer_kind, (self.rank - 1) % self.num)
        self.taken = [s for s in self.taken if s <= step]

    def restore(self, vote, abstract_state, at_most: int | None = None) -> tuple[Any, Any, int, str] | None:
        """(state, data_state, step, detail) from the newest snapshot step complete on all hosts (and
        <= `at_most` when given), or None.

        Collective: every process calls it. `vote` is a `Vote` of width >= 8.
        """
        k = vote.width // 2
        bounded = lambda steps: [s for s in steps if at_most is None or s <= at_most][-k:]  # noqa: E731
        own = bounded(self.keeper.steps(self.own_kind, self.rank))
        held = bounded(self.keeper.steps(self.peer_kind, (self.rank - 1) % self.num)) if self.num > 1 else []
        row = np.full(vote.width, -1, np.float32)
        row[:len(own)], row[k:k + len(held)] = own, held
        table = vote.now(row)
        own_sets = [set(int(s) for s in r[:k] if s >= 0) for r in table]
        held_sets = [set(int(s) for s in r[k:] if s >= 0) for r in table]  # process p holds rank p-1's replica
        candidates = set().union(*own_sets, *held_sets)
        complete = [s for s in candidates
                    if all(s in own_sets[r] or (self.num > 1 and s in held_sets[(r + 1) % self.num])
                           for r in range(self.num))]
        if not complete:
            return None
        step = max(complete)
        need_peer = any(step not in own_sets[r] for r in range(self.num))
        shardings = self.tree_shardings
        abstract = (abstract_state, jax.ShapeDtypeStruct((self.data_sharding.mesh.size, DATA_BYTES), np.uint8))
        have_own = step in own_sets[self.rank]
        own_blocks = unpack(self.keeper.get(step, self.own_kind, self.rank))[1] if have_own else None
        tree = None
        if need_peer:
            held_blocks = (unpack(self.keeper.get(step, self.peer_kind, (self.rank - 1) % self.num))[1]
                           if step in held_sets[self.rank] else None)
            source_of = {t: s for s, t in self._perm}
            shifted = self._build(abstract, shardings, held_blocks, source_of)
            returned = self._from_peer(shifted)  # replica blocks travel back to their owners
            tree = returned if not have_own else None
        if tree is None:
            tree = self._build(abstract, shardings, own_blocks)
        state, data_array = tree
        data_state = _decode_data_state(np.asarray(data_array.addressable_shards[0].data))
        detail = "own shards" if not need_peer else (
            "own shard" if have_own else f"replica from peer host {(self.rank + 1) % self.num}")
        return state, data_state, step, detail

    def _build(self, abstract, shardings, blocks, source_of=None):
        """Global arrays from this host's blocks (zeros where `blocks` is None: a lost shard)."""
        flat = list(self.mesh.devices.flat)
        pos = {d: i for i, d in enumerate(flat)}
        paths = jax.tree_util.tree_flatten_with_path(abstract)[0]
        datas, devices, plan = [], [], []
        for (path, leaf), sharding in zip(paths, jax.tree.leaves(shardings)):
            key, first = jax.tree_util.keystr(path), len(datas)
            indices = sharding.devices_indices_map(leaf.shape)
            for device in sharding.addressable_devices:
                src = device if source_of is None else flat[source_of[pos[device]]]
                index = _index_key(indices[src], leaf.shape)
                if blocks is None:
                    datas.append(np.zeros([b - a for a, b in index], leaf.dtype))
                else:
                    datas.append(blocks[key][index])
                devices.append(device)
            plan.append((leaf.shape, sharding, first, len(datas)))
        arrays = jax.device_put(datas, devices)  # one batched transfer
        out = [jax.make_array_from_single_device_arrays(shape, sharding, arrays[a:b])
               for shape, sharding, a, b in plan]
        return jax.tree.unflatten(jax.tree.structure(abstract), out)

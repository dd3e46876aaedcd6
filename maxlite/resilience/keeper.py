"""Keepers: where a host's in-memory snapshot shards live, outside the training processes.

A keeper stores opaque blobs keyed by (step, kind, rank): kind `own` is rank's shard, kind `peer`
is a replica of shard `rank` held by the next host. A blob becomes visible only once complete,
so a crash half-way through a snapshot never leaves a usable torn one.

- `ShmKeeper`: files in host shared memory (`/dev/shm`), for Slurm and plain multi-process runs;
  they outlive the processes (not the node).
- `RayKeeper`: a detached, named Ray actor per rank, pinned to the node that created it; Ray
  Train restarting the whole worker group does not touch it (objects a worker `ray.put` would
  die with the worker; the actor holds its own copy).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil


def run_key(run_dir: str) -> str:
    return hashlib.sha1(os.path.abspath(run_dir).encode() if "://" not in run_dir else run_dir.encode()).hexdigest()[:12]


class ShmKeeper:
    def __init__(self, run_dir: str, root: str | None = None):
        root = root or ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
        self.dir = os.path.join(root, f"maxlite-snap-{run_key(run_dir)}")
        os.makedirs(self.dir, exist_ok=True)
        self.where = f"host shared memory {self.dir}"

    def _path(self, step: int, kind: str, rank: int) -> str:
        return os.path.join(self.dir, f"{step:010d}.{kind}.{rank}.snap")

    def put(self, step: int, kind: str, rank: int, blob) -> None:
        path = self._path(step, kind, rank)
        with open(f"{path}.tmp{os.getpid()}", "wb") as f:
            f.write(blob)
        os.replace(f"{path}.tmp{os.getpid()}", path)  # visible only when complete

    def steps(self, kind: str, rank: int) -> list[int]:
        suffix = f".{kind}.{rank}.snap"
        return sorted(int(n.split(".", 1)[0]) for n in os.listdir(self.dir) if n.endswith(suffix))

    def get(self, step: int, kind: str, rank: int):
        """The blob, memory-mapped (no copy: the file is already in RAM)."""
        with open(self._path(step, kind, rank), "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def drop(self, step: int, kind: str, rank: int) -> None:
        for name in os.listdir(self.dir):
            if name.startswith(f"{step:010d}.{kind}.{rank}.snap"):  # incl. a torn .tmp
                try:
                    os.remove(os.path.join(self.dir, name))
                except FileNotFoundError:
                    pass

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


_ACTOR_CLASS = None


def _actor_class():
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        @ray.remote(num_cpus=0, max_restarts=0)
        class SnapshotKeeperActor:
            """Holds blobs in its own heap; a copy, so nothing depends on the putting worker."""

            def __init__(self):
                self.blobs: dict[tuple[int, str, int], bytes] = {}

            def put(self, step, kind, rank, blob):
                self.blobs[(step, kind, rank)] = bytes(blob)

            def steps(self, kind, rank):
                return sorted(s for (s, k, r) in self.blobs if k == kind and r == rank)

            def get(self, step, kind, rank):
                return self.blobs[(step, kind, rank)]

            def drop(self, step, kind, rank):
                self.blobs.pop((step, kind, rank), None)

            def node(self):
                return ray.get_runtime_context().get_node_id()

        _ACTOR_CLASS = SnapshotKeeperActor
    return _ACTOR_CLASS


class RayKeeper:
    """One detached actor per rank (`maxlite-keeper-<run>-<rank>`), created on this worker's node."""

    NAMESPACE = "maxlite"

    def __init__(self, run_dir: str, rank: int):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.name = f"maxlite-keeper-{run_key(run_dir)}-{rank}"
        node = ray.get_runtime_context().get_node_id()
        self.actor = _actor_class().options(
            name=self.name, namespace=self.NAMESPACE, lifetime="detached", get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        self.where = f"Ray actor {self.name}"

    def put(self, step, kind, rank, blob) -> None:
        import ray
        ray.get(self.actor.put.remote(step, kind, rank, blob))

    def steps(self, kind, rank) -> list[int]:
        import ray
        return ray.get(self.actor.steps.remote(kind, rank))

    def get(self, step, kind, rank) -> bytes:
        import ray
        return ray.get(self.actor.get.remote(step, kind, rank))

    def drop(self, step, kind, rank) -> None:
        import ray
        ray.get(self.actor.drop.remote(step, kind, rank))

    def clear(self) -> None:
        import ray
        ray.kill(self.actor)


def make_keeper(kind: str, run_dir: str, rank: int):
    """`auto` → Ray when this process runs inside a Ray worker, else /dev/shm."""
    if kind == "auto":
        try:
            import ray
            kind = "ray" if ray.is_initialized() else "shm"
        except ImportError:
            kind = "shm"
    return RayKeeper(run_dir, rank) if kind == "ray" else ShmKeeper(run_dir)  # config.py checked the name

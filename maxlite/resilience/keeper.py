"""Keepers: where a host's in-memory snapshot shards live, outside the training processes.

A keeper stores opaque blobs keyed by (step, kind, rank): kind `own` is rank's shard, kind `peer`
is a replica of shard `rank` held by the next host. A blob becomes visible only once complete,
so a crash half-way through a snapshot never leaves a usable torn one.

- `ShmKeeper`: files in host shared memory (`/dev/shm`), for Slurm and plain multi-process runs;
  they outlive the processes (not the node).
- `RayKeeper` (maxlite/launch/ray_keeper.py, handed over by the Ray launcher): a detached, named
  Ray actor per rank, pinned to the node that created it; Ray Train restarting the whole worker
  group does not touch it.
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


def make_keeper(kind: str, run_dir: str, rank: int, launcher_keeper=None):
    """`auto` → the launcher's keeper (the Ray launcher hands one over) or else /dev/shm; `shm`;
    `ray` → the launcher's keeper, which only the Ray launcher provides."""
    if kind == "shm" or (kind == "auto" and launcher_keeper is None):
        return ShmKeeper(run_dir)
    assert launcher_keeper is not None, "config_checks.check_keeper refuses ray without the Ray launcher"
    return launcher_keeper(run_dir, rank)

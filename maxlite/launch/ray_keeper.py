"""The in-memory snapshot keeper under Ray: a detached, named actor per rank, pinned to the node
that created it. Ray Train restarting the whole worker group does not touch it (objects a worker
`ray.put` would die with the worker; the actor holds its own copy). The Ray launcher hands
`RayKeeper` to `train()`; the keeper interface is in maxlite/resilience/keeper.py.
"""

from __future__ import annotations

from maxlite.resilience.keeper import run_key

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

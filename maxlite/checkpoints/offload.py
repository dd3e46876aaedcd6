"""What an async save holds the loop for: enqueueing one device→host copy, nothing more.

Orbax's own async save blocks the caller for its device→host copy plus its per-save Python
(barriers, directories, a host transfer per shard, a dozen thread starts): 40-50 ms for a 240 MiB
state on a 2-core host, more for bigger trees. Instead the loop enqueues one `jax.device_put` of the state into pinned host memory, which
returns at once (the runtime finishes that copy before any later step that donates the same
buffers may overwrite them), and one writer thread runs Orbax's save on the host copy.

Orbax's barriers default to XLA collectives, which from a second thread could interleave with the
loop's own collectives differently on each host. With several processes the saves therefore use
Orbax's coordination-service barriers (`experimental_orbax_use_distributed_barrier`), the kind
its own background threads use.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

HOST_KIND = "pinned_host"


def host_kind_available() -> bool:
    """Whether this backend has pinned host memory (jax 0.10's CPU, GPU and TPU backends have it)."""
    import jax
    return any(m.kind == HOST_KIND for m in jax.local_devices()[0].addressable_memories())


def to_host(tree: Any) -> Any:
    """A copy of `tree` in pinned host memory, same shardings otherwise; enqueued, not waited for."""
    import jax
    return jax.device_put(tree, jax.tree.map(lambda x: x.sharding.with_memory_kind(HOST_KIND), tree))


def use_coordination_barriers() -> None:
    """Route Orbax's barriers through JAX's coordination service (safe from any thread)."""
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost  # noqa: F401 — defines the flag (orbax <0.13)

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # we are not an absl app; the flag's value is read, never parsed
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


class Writer:
    """One background thread: saves run one at a time, in the order they were handed over."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="maxlite-checkpoint")
        self._future: concurrent.futures.Future | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        self._future = self._pool.submit(fn)

    def busy(self) -> bool:
        return self._future is not None and not self._future.done()

    def wait(self) -> None:
        """Until the last save is done; re-raises its error."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

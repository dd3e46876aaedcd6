"""The seconds XLA spent compiling (or loading from the persistent cache) programs on this thread,
from JAX's own backend-compile event: the clock charges them to compilation wherever a step or a
section compiled (the rollout engine compiling for a new prompt length or batch width at step 40,
not only the attempt's first step), and leaves such a step out of the straggler statistics. Per
thread, so that an asynchronous rollout thread's compiles are not charged to the training loop."""

from __future__ import annotations

import threading

# JAX's event around each XLA compile (jax/_src/dispatch.py BACKEND_COMPILE_EVENT; the per-thread test
# compiles for real, so a renamed event fails it)
EVENT = "/jax/core/compile/backend_compile_duration"
_seconds: dict[int, float] = {}  # thread ident → seconds compiling
_lock = threading.Lock()
_listening = False


def _heard(event: str, duration_secs: float, **_) -> None:
    if event == EVENT:
        me = threading.get_ident()
        with _lock:
            _seconds[me] = _seconds.get(me, 0.0) + duration_secs


def on_this_thread() -> float:
    """Seconds this thread has spent in XLA's compile since the first call (which starts listening)."""
    global _listening
    with _lock:
        if not _listening:
            import jax

            jax.monitoring.register_event_duration_secs_listener(_heard)
            _listening = True
        return _seconds.get(threading.get_ident(), 0.0)

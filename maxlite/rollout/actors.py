"""Rollout workers as Ray actors of their own (`rollout_workers: N`; NeMo-RL's separate generation
cluster): each builds the rollout engine on its own process's devices and generates for a share of
the prompts; the trainer only cuts, scores and trains.

    pool = WorkerPool(cfg)                       # N actors, started on first use
    done = pool.generate(params, prompts, sampling, key)   # the Engine interface (engine.py)

Weights: the trainer's parameters as one host numpy tree, one `ray.put` per new weight version (a
new parameters object: the pool compares identity), which every actor reads from Ray's object
store; no files. `push(params)` does it on the caller's thread (the trainer's, before it donates
those buffers), `generate` then takes the pushed handle.

Shares: the prompts are split into contiguous runs, one per actor (a prompt's G completions on one
actor); each actor samples with the step's key, its first prompt's index in the batch and the
batch's longest prompt, so its completions are the ones the in-process engine draws for those
prompts (a token's key is fold_in(key, prompt, completion, token): continuous.py).

Faults: an actor that dies during generate (RayActorError: its process killed, its node lost) is
replaced by a new one, which reads the last pushed weights, and its share is run again: the same
keys give the same completions. A hung actor (alive, never answering) is treated alike once its
share is `rollout_worker_timeout_s` old (counted from the share's submission: the actor's start,
the weights' load and the first compile are inside it; 0: wait forever): it is killed
(`ray.kill`), replaced, its share run again. Replacements are counted (`restarts`, logged as
`rollout_worker_restarts`; those for a hang also in `hangs`, `rollout_worker_hangs`), each said in
one line that names the cause; a share replaced `_TRIES` times fails the step. `Deadlines` is the
decision of which share is overdue, on an injected clock.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import numpy as np

from maxlite.rollout.sampling import Completions, Sampling
from maxlite.schema import ConfigError

_TRIES = 3  # replacements of one share before the step fails


class RolloutWorker:
    """One rollout worker (a Ray actor): the engine for `cfg`'s model on this process's devices.
    (Tests subclass it to pause or hang inside generate: WorkerPool's `worker`.)"""

    def __init__(self, cfg):
        from maxlite.rollout.engine import make_engine
        from maxlite.state import abstract_params

        self.cfg = cfg
        from maxlite.launch.cpu_affinity import pin_if_asked
        pin_if_asked(cfg, cfg.rollout_worker_cpus, "rollout worker")  # before JAX starts
        self.graphdef, _ = abstract_params(cfg)
        self.engine = make_engine(cfg, self.graphdef)
        self.params = None

    def pid(self) -> int:
        return os.getpid()

    def load(self, pure: dict) -> None:
        """Take the weights (`pure`: the object store's numpy tree, resolved by Ray) onto this process's device."""
        import jax

        from maxlite.bridge import params as P

        self.params = jax.device_put(P.to_state(self.cfg, pure))

    def generate(self, prompts, sampling: Sampling, key_data: np.ndarray, first_prompt: int, pad_to: int):
        """(tokens, logps, stops, stats) of `prompts`, the prompt indices starting at `first_prompt`."""
        import jax

        assert self.params is not None, "weights are pushed before generate"
        done = self.engine.generate(self.params, prompts, sampling, jax.random.wrap_key_data(key_data),
                                    first_prompt=first_prompt, pad_to=pad_to)
        return done.tokens, done.logps, done.stops, done.stats


def start_ray() -> None:
    """Ray for the actors: already up inside ray_entry's workers, else a local cluster of this machine."""
    try:
        import ray
    except ImportError:
        raise ConfigError("rollout_workers > 0 needs Ray: pip install 'ray[train]', or set rollout_workers=0")
    if ray.is_initialized():
        return
    try:
        ray.init(include_dashboard=False, log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - any failure to start is the user's to see, in one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"rollout_workers > 0: Ray did not start here ({type(e).__name__}: {first}); "
                          "start a cluster (ray start --head) or set rollout_workers=0") from e


class Pushed:
    """Weights in the object store: what `push` returns and `generate` takes."""

    def __init__(self, ref, params):
        self.ref, self.params = ref, params


class Deadlines:
    """When each outstanding share is overdue: `timeout_s` after it was (re)submitted, on `clock`
    (seconds, monotonic); 0: never."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self.clock = timeout_s, clock
        self.due: dict[int, float] = {}

    def start(self, share: int) -> None:
        self.due[share] = self.clock() + self.timeout_s

    def done(self, share: int) -> None:
        self.due.pop(share, None)

    def overdue(self) -> list[int]:
        now = self.clock()
        return sorted(i for i, t in self.due.items() if self.timeout_s and now >= t)

    def wait_s(self) -> float | None:
        """How long to wait for an answer before the next share falls due (None: as long as it takes)."""
        if not self.timeout_s or not self.due:
            return None
        return max(min(self.due.values()) - self.clock(), 0.0)


class WorkerPool:
    """`rollout_workers` actors of class `worker` (started with `cfg, *worker_args`) behind the
    Engine interface; `clock` times the shares (Deadlines)."""

    def __init__(self, cfg, worker: type = RolloutWorker, worker_args: tuple = (),
                 clock: Callable[[], float] = time.monotonic):
        self.cfg, self.worker, self.worker_args, self.clock = cfg, worker, worker_args, clock
        self.actors: list = []
        self.loaded: list = []  # the Pushed each actor holds
        self.pushed: Pushed | None = None
        self.restarts = 0
        self.hangs = 0  # of the restarts, those of an actor that never answered (the others died)
        # one generate at a time (the pipeline's thread and the loop's eval): each actor's load and
        # generate calls must not interleave with another caller's
        self.lock = threading.Lock()

    def _start(self):
        import ray

        # the trainer's JAX platform and XLA flags: same compiler settings, same numbers (a Ray Train
        # worker's own env reaches neither the cluster's default workers nor their actors: GOTCHAS)
        env = {k: os.environ[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS") if k in os.environ}
        remote = ray.remote(num_cpus=self.cfg.rollout_worker_cpus, num_gpus=self.cfg.rollout_worker_gpus,
                            max_restarts=0, runtime_env={"env_vars": env})(self.worker)
        return remote.remote(self.cfg, *self.worker_args)

    def _ready(self) -> None:
        if not self.actors:  # first called on the loop's thread, before any background rollout
            start_ray()
            self.actors = [self._start() for _ in range(self.cfg.rollout_workers)]
            self.loaded = [None] * len(self.actors)

    def push(self, params) -> tuple[Pushed, float]:
        """(the weights in Ray's object store, seconds): a new `ray.put` only for a new parameters object."""
        import ray

        from maxlite.bridge import params as P

        self._ready()
        started = time.perf_counter()
        if isinstance(params, Pushed):
            return params, 0.0
        if self.pushed is None or self.pushed.params is not params:
            self.pushed = Pushed(ray.put(P.to_pure(params)), params)
        return self.pushed, time.perf_counter() - started

    def generate(self, params, prompts, sampling: Sampling, key) -> Completions:
        pushed, _ = self.push(params)
        with self.lock:
            return self._generate(pushed, prompts, sampling, key)

    def _generate(self, pushed: Pushed, prompts, sampling: Sampling, key) -> Completions:
        import jax
        import ray
        from ray.exceptions import RayActorError

        started = time.perf_counter()
        n = len(self.actors)
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        shares = [(bounds[i], prompts[bounds[i]:bounds[i + 1]]) for i in range(n) if bounds[i + 1] > bounds[i]]
        args = (sampling, np.asarray(jax.random.key_data(key)), max(map(len, prompts)))
        deadlines = Deadlines(self.cfg.rollout_worker_timeout_s, self.clock)
        futures, tries, results = {}, [0] * len(shares), {}
        for i, share in enumerate(shares):
            futures[i] = self._submit(i, pushed, share, args)
            deadlines.start(i)
        while len(results) < len(shares):
            waiting = {futures[i]: i for i in range(len(shares)) if i not in results}
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=deadlines.wait_s())
            failed = []
            for ref in ready:
                i = waiting[ref]
                deadlines.done(i)
                try:
                    results[i] = ray.get(ref)
                except RayActorError as e:  # ActorDiedError, ActorUnavailableError
                    failed.append((i, f"died ({type(e).__name__})", e))
            failed += [(i, f"hung (no answer in rollout_worker_timeout_s={self.cfg.rollout_worker_timeout_s:g} s)",
                        None) for i in deadlines.overdue()]
            for i, why, error in failed:
                if tries[i] == _TRIES:
                    if error is not None:
                        raise error
                    raise TimeoutError(f"rollout worker {i} {why} {_TRIES + 1} times in one step: raise "
                                       "rollout_worker_timeout_s if its shares are only slow (0: wait forever)")
                tries[i] += 1
                self._replace(i, why, hung=error is None)
                futures[i] = self._submit(i, pushed, shares[i], args)
                deadlines.start(i)
        tokens, logps, stops = [], [], []
        for i in range(len(shares)):
            tokens += results[i][0]
            logps += results[i][1]
            stops += results[i][2]
        return Completions(tokens, logps, stops, {"seconds": time.perf_counter() - started, "restarts": self.restarts,
                                                  "hangs": self.hangs})

    def _replace(self, i: int, why: str, hung: bool) -> None:
        """Actor i killed (a hung one: a dead one is gone already) and a fresh one in its place."""
        import ray

        if hung:
            ray.kill(self.actors[i], no_restart=True)
            self.hangs += 1
        self.restarts += 1
        self.actors[i], self.loaded[i] = self._start(), None
        print(f"maxlite: rollout worker {i} {why}: replaced, its share run again "
              f"(rollout_worker_restarts={self.restarts})", flush=True)

    def _submit(self, i: int, pushed: Pushed, share, args):
        sampling, key_data, pad_to = args
        if self.loaded[i] is not pushed:
            self.actors[i].load.remote(pushed.ref)  # actor calls run in order: before the generate below
            self.loaded[i] = pushed
        first, prompts = share
        return self.actors[i].generate.remote(prompts, sampling, key_data, first, pad_to)

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.loaded = [], []

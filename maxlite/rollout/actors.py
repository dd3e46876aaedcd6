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
keys give the same completions. Replacements are counted (`restarts`, logged as
`rollout_worker_restarts`). A hung actor (alive but never answering) is not detected: generate
waits for it.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from maxlite.rollout.sampling import Completions, Sampling
from maxlite.schema import ConfigError

_TRIES = 3  # replacements of one share before the step fails


class RolloutWorker:
    """One rollout worker (a Ray actor): the engine for `cfg`'s model on this process's devices.

    `hold_dir` is a test hook: generate writes `<hold_dir>/<pid>.started` and waits for
    `<hold_dir>/go` before sampling, so a test can kill the worker inside generate."""

    def __init__(self, cfg, hold_dir: str = ""):
        from maxlite.rollout.engine import make_engine
        from maxlite.state import abstract_params

        self.cfg, self.hold_dir = cfg, hold_dir
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

        if self.hold_dir:
            open(os.path.join(self.hold_dir, f"{os.getpid()}.started"), "w").close()
            while not os.path.exists(os.path.join(self.hold_dir, "go")):
                time.sleep(0.05)
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


class WorkerPool:
    """`rollout_workers` RolloutWorker actors behind the Engine interface."""

    def __init__(self, cfg, hold_dir: str = ""):
        self.cfg, self.hold_dir = cfg, hold_dir
        self.actors: list = []
        self.loaded: list = []  # the Pushed each actor holds
        self.pushed: Pushed | None = None
        self.restarts = 0
        # one generate at a time (the pipeline's thread and the loop's eval): each actor's load and
        # generate calls must not interleave with another caller's
        self.lock = threading.Lock()

    def _start(self):
        import ray

        # the trainer's JAX platform and XLA flags: same compiler settings, same numbers (a Ray Train
        # worker's own env reaches neither the cluster's default workers nor their actors: GOTCHAS)
        env = {k: os.environ[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS") if k in os.environ}
        remote = ray.remote(num_cpus=self.cfg.rollout_worker_cpus, num_gpus=self.cfg.rollout_worker_gpus,
                            max_restarts=0, runtime_env={"env_vars": env})(RolloutWorker)
        return remote.remote(self.cfg, self.hold_dir)

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
        futures = {i: self._submit(i, pushed, share, args) for i, share in enumerate(shares)}
        results = {}
        for i, share in enumerate(shares):
            for attempt in range(_TRIES + 1):
                try:
                    results[i] = ray.get(futures[i])
                    break
                except RayActorError:  # ActorDiedError, ActorUnavailableError
                    if attempt == _TRIES:
                        raise
                    self.restarts += 1
                    self.actors[i], self.loaded[i] = self._start(), None
                    futures[i] = self._submit(i, pushed, share, args)
        tokens, logps, stops = [], [], []
        for i in range(len(shares)):
            tokens += results[i][0]
            logps += results[i][1]
            stops += results[i][2]
        return Completions(tokens, logps, stops, {"seconds": time.perf_counter() - started, "restarts": self.restarts})

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

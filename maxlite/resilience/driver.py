"""A minimal training loop wired to `Resilience` — the reference wiring for `maxlite/train.py`,
used by the resilience tests and benchmark: `python -m maxlite.resilience.driver [--ckpt-every=N]
base.yml key=value ...` (a disk checkpoint via Orbax StandardCheckpointer under {run}/ckpt/).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _latest(ckpt_root: str) -> int:
    if not os.path.isdir(ckpt_root):
        return -1
    steps = [int(n) for n in os.listdir(ckpt_root) if n.isdigit()
             and os.path.exists(os.path.join(ckpt_root, n, "done"))]
    return max(steps, default=-1)


def save_disk(ckpt_root: str, step: int, state, data_state, primary: bool, process_index: int) -> None:
    import jax
    import orbax.checkpoint as ocp

    path = os.path.join(ckpt_root, str(step))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.abspath(os.path.join(path, "state")), state, force=True)
    ckptr.wait_until_finished()
    with open(os.path.join(path, f"data_p{process_index}.json"), "w") as f:
        json.dump(data_state, f)
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(f"maxlite-ckpt-{step}")
    if primary:
        open(os.path.join(path, "done"), "w").close()  # crash-consistent: complete only with this
    ckptr.close()
    del jax


def load_disk(ckpt_root: str, step: int, abstract, shardings, process_index: int):
    import jax
    import orbax.checkpoint as ocp

    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    ckptr = ocp.StandardCheckpointer()
    state = ckptr.restore(os.path.abspath(os.path.join(ckpt_root, str(step), "state")), target)
    ckptr.close()
    with open(os.path.join(ckpt_root, str(step), f"data_p{process_index}.json")) as f:
        return state, json.load(f)


def run(argv, ckpt_every: int = 0) -> int:
    started = time.monotonic()
    from maxlite import config as C
    from maxlite.resilience import Resilience

    cfg = C.load(argv)
    res = Resilience(cfg, started)  # first: signals during setup/compilation are caught
    from maxlite import mesh as mesh_lib

    mesh_lib.initialize_distributed()
    import jax
    from flax import nnx

    from maxlite import data, optim, state as state_lib, step as step_lib
    from maxlite.rundir import RunDir

    cfg = C.resolve(cfg, jax.device_count(), mesh_lib.num_slices_of(jax.devices()), jax.process_count())
    primary, me = jax.process_index() == 0, jax.process_index()
    rundir = RunDir(cfg, primary)
    mesh = mesh_lib.make_mesh(cfg)
    tx, schedule = optim.make_optimizer(cfg), optim.learning_rate_schedule(cfg)
    graphdef, abstract, shardings = state_lib.abstract_state(cfg, mesh, tx)
    res.attach(rundir.path, mesh, shardings, primary, on_status=rundir.set_status)
    ckpt_root = os.path.join(rundir.path, "ckpt")

    disk_step = _latest(ckpt_root)
    t = time.perf_counter()
    restored = res.restore(abstract, newer_than=disk_step)
    data_state = None
    if restored is not None:
        state, data_state = restored.state, restored.data_state
    elif disk_step >= 0:
        state, data_state = load_disk(ckpt_root, disk_step, abstract, shardings, me)
        jax.block_until_ready(state)
        print(f"maxlite: restored step {disk_step} from disk ({ckpt_root}) in {time.perf_counter() - t:.2f}s",
              flush=True)
    else:
        state = state_lib.create_state(cfg, mesh, tx, shardings)
    batches = data.make_iterator(cfg, "train", me, jax.process_count())
    if data_state is not None:
        batches.set_state(data_state)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    train_step = step_lib.jit_train_step(cfg, graphdef, tx, schedule, shardings, batch_sharding)
    first = int(jax.device_get(state.step))
    rundir.set_status("running", step=first)
    losses = open(os.path.join(rundir.path, f"losses_p{me}.jsonl"), "a")

    def read(pending):
        step, metrics = pending
        with res.device_wait():
            loss = float(jax.device_get(metrics["loss"]))
        losses.write(json.dumps({"step": step, "loss": loss}) + "\n")
        losses.flush()

    reason, pending, step = None, None, first
    res.setup_end()
    try:
        with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
            for step in range(first, cfg.steps):
                res.step_begin(step)
                with res.data_wait():
                    local = next(batches)
                batch = {k: jax.make_array_from_process_local_data(batch_sharding, v) for k, v in local.items()}
                with res.device_wait():  # on CPU a dispatch may run the step inline, waiting for peers
                    state, metrics = train_step(state, batch)
                if pending is not None:
                    read(pending)
                pending = (step + 1, metrics)
                reason = res.step_end(step + 1, state, batches.get_state)
                if ckpt_every and (step + 1) % ckpt_every == 0 and not reason:
                    with res.section("checkpoint"):
                        save_disk(ckpt_root, step + 1, state, batches.get_state(), primary, me)
                if reason:
                    break
            if pending is not None:
                read(pending)
            done = int(jax.device_get(state.step))
            if reason in ("preempted", "max_time") or (reason is None and ckpt_every):
                with res.section("checkpoint"):
                    save_disk(ckpt_root, done, state, batches.get_state(), primary, me)
        code, status, fields = res.finish(reason)
        rundir.set_status(status, step=done, exit_code=code, **fields)
        if primary:
            print(f"maxlite: {status} at step {done} (exit {code}); goodput {fields.get('goodput')}", flush=True)
        return code
    except BaseException as e:
        res.close()
        rundir.set_status("failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        losses.close()
        getattr(batches, "close", lambda: None)()


def ray_worker(loop_config: dict) -> int:
    """Ray Train worker function running `run` (CPU workers set up jax.distributed first)."""
    import ray.train

    from maxlite.launch.ray_trainer import _setup_cpu_distributed

    ctx = ray.train.get_context()
    if ctx.get_world_size() > 1:
        _setup_cpu_distributed(ctx.get_world_rank(), ctx.get_world_size())
    code = run(loop_config["argv"], loop_config.get("ckpt_every", 0))
    if code:
        raise SystemExit(code)
    return code


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    every = 0
    for a in list(argv):
        if a.startswith("--ckpt-every="):
            every = int(a.split("=", 1)[1])
            argv.remove(a)
    from maxlite import config as C
    try:
        return run(argv, every)
    except C.ConfigError as e:
        print(f"maxlite: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

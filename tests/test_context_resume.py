"""Context parallelism across a restart: a run saved at context=4 resumes at context=2 on the same
batches (batch_hash) and losses."""

import jax
import numpy as np
from flax import nnx

from maxlite import config as C, mesh as mesh_lib, resume, state as state_lib
from maxlite.build import build as build_run
from maxlite.checkpoints.saver import Checkpointer
from maxlite.data.synthetic import make_synthetic_iterator
from helpers import SMALL

ARGV = [a for a in SMALL if not a.startswith(("max_target_length=", "per_device_batch_size="))] + [
    "max_target_length=32", "attention=blockwise", "attention_block_size=4"]


def test_a_run_saved_at_context_4_resumes_at_context_2_on_the_same_batches(tmp_path):
    """Saved after 2 steps over 4 shards; restored onto 2 devices with context=2 (the same global
    batch of 2: half a sequence, then one per device), the third step reads the batch the
    uninterrupted run reads (batch_hash) and gives its loss."""
    runs = [f"base_output_directory={tmp_path}/runs", "run_name=src", "async_checkpointing=false"]

    def wired(devices: int, context: int):
        argv = [*ARGV, *runs, f"per_device_batch_size={2 / devices}", f"ici_context_parallelism={context}",
                "ici_fsdp_parallelism=-1"]
        built = build_run(C.load(argv), jax.devices()[:devices], num_processes=1)
        return built, make_synthetic_iterator(built.cfg, "train", 0, 1)

    def step(built, state, data):
        with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
            batch = {k: jax.device_put(v, built.batch_sharding) for k, v in next(data).items()}
            return built.train_step(state, batch)

    first, data = wired(4, 4)
    state = first.init_state()
    for _ in range(2):
        state, _ = step(first, state, data)
    saver = Checkpointer(first.cfg, True, state_lib.nbytes(first.abstract))
    assert saver.save(2, state, data)
    saver.close()
    _, want = step(first, state, data)  # the uninterrupted run's third step

    second, data2 = wired(2, 2)
    assert (second.cfg.axis_size("context"), second.cfg.global_batch_size) == (2, first.cfg.global_batch_size)
    reader = Checkpointer(second.cfg, True, state_lib.nbytes(second.abstract))
    started = resume.decide(second, reader, data2, 0, True)
    reader.close()
    assert (started.step, started.source) == (2, "checkpoint")
    _, got = step(second, started.state, data2)
    assert float(got["batch_hash"]) == float(want["batch_hash"])
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-4)

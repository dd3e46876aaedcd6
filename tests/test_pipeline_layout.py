"""Pipeline stages on a Ray multislice run, as we would send it: the workers Ray is asked for, the
recipe they resolve, and the mesh their TPU devices form (libtpu's devices for the topology, not
backed by hardware, carry each chip's host and slice as real ones do): across slices a stage is a
slice, so only activations cross the data-centre network, and a host's chips serve one stage."""

import importlib.util
import math

import numpy as np
import pytest

from maxlite import config as C, mesh as mesh_lib
from maxlite.launch import ray_trainer as RT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu not installed: pip install 'maxlite[tpu]'")
SLICES, CHIPS_PER_HOST = 2, 4


def _stages(*pipeline: str):
    """(the resolved recipe, the Ray scaling config, [stage] → {(slice, host)}) for two v6e-16 slices."""
    from maxlite.plan import topology

    cfg = RT.check(C.load(["base.yml", "ray_use_tpu=true", "tpu_topology=4x4", "tpu_accelerator_type=TPU-V6E",
                           f"num_slices={SLICES}", "ray_num_workers=8", "model_name=tiny", "per_device_batch_size=1",
                           "dcn_data_parallelism=1", *pipeline]))
    devices = topology.devices(topology.parse("v6e:4x4", SLICES))
    grid = mesh_lib.make_mesh(cfg, devices).devices  # [data, stage, fsdp, context, expert, tensor]
    stage_dim = mesh_lib.MESH_AXES.index("stage")
    stages = [{(d.slice_index, d.process_index) for d in np.take(grid, s, axis=stage_dim).ravel()}
              for s in range(grid.shape[stage_dim])]
    return cfg, RT.scaling_config(cfg), stages


def test_stages_across_slices_are_the_slices_and_their_workers():
    cfg, scaling, stages = _stages("dcn_pipeline_parallelism=2")
    assert scaling.num_workers == 8 and scaling.resources_per_worker == {"TPU": CHIPS_PER_HOST}
    assert (cfg.dcn_pipeline_parallelism, cfg.ici_fsdp_parallelism, cfg.num_devices) == (2, 16, 32)
    assert math.prod(cfg.parallelism("dcn")) == SLICES
    hosts = 16 // CHIPS_PER_HOST
    for s, members in enumerate(stages):  # stage s: all of slice s's hosts and chips, nothing else
        assert {slice_ for slice_, _ in members} == {s}
        assert {host for _, host in members} == set(range(s * hosts, (s + 1) * hosts))


def test_stages_inside_and_across_slices_keep_each_host_in_one_stage():
    """4 stages: 2 per slice (ici) × the 2 slices (dcn, the outer factor): stages 0, 1 on slice 0."""
    cfg, _, stages = _stages("dcn_pipeline_parallelism=2", "ici_pipeline_parallelism=2")
    assert cfg.axis_size("stage") == 4 and cfg.ici_fsdp_parallelism == 8
    assert [{slice_ for slice_, _ in m} for m in stages] == [{0}, {0}, {1}, {1}]
    hosts = [host for m in stages for _, host in m]
    assert len(hosts) == len(set(hosts)) == 8  # no host's chips split between two stages

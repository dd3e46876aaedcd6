"""Ironwood (TPU7x) in the planner: two JAX devices per chip, so a slice of N chips plans on 2N
devices, and each device gets half the chip's published figures."""

import importlib.util

import pytest

from maxlite.chips import PEAK_TFLOPS
from maxlite.plan import compile as plan_compile, topology as T

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu not installed: pip install 'maxlite[tpu]'")


def test_tpu7x_names_count_chips_and_hint_from_tensorcores():
    topo = T.parse("tpu7x:4x8x8")  # MaxText's 256-chip DeepSeek-V3 recipe
    assert (topo.num_chips, topo.num_devices, topo.devices_per_slice) == (256, 512, 512)
    with pytest.raises(T.TopologyError, match="tpu7x:4x8x8"):
        T.parse("tpu7x-512")  # TensorCores, as GKE names it
    chip = T.CHIPS["tpu7x"]
    # per device: half of the chip's 2307 TFLOP/s and 192 GiB
    assert chip.peak_tflops * chip.devices_per_chip == 2307.0 and chip.hbm_bytes * 2 == 192 * T.GIB


@needs_libtpu
def test_tpu7x_devices_are_what_the_recipe_resolves_for():
    topo = T.parse("tpu7x:2x2x1")
    devs = T.devices(topo)
    assert len(devs) == topo.num_devices == 8
    assert any(devs[0].device_kind.startswith(k) for k in PEAK_TFLOPS)  # MFU has a peak to divide by
    cfg = plan_compile.resolve(["base.yml", "model_name=tiny"], topo)
    assert cfg.axis_size("fsdp") == 8  # the -1 axis filled with devices, not chips

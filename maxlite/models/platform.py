"""Which platform the program being traced is built for (attention and matmuls pick their spelling)."""

from __future__ import annotations

import jax


def target_platform() -> str:
    """The platform the program is built for: the active mesh's devices (the planner compiles for a
    TPU topology from a CPU process), else the default backend's."""
    mesh = jax.sharding.get_abstract_mesh()  # set by jax.set_mesh; also inside jit
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.devices()[0].platform

"""Which platform the program being traced is built for (attention and matmuls pick their spelling)."""

from __future__ import annotations

import jax


def target_platform() -> str:
    """The platform the program is built for: the active mesh's devices (the planner compiles for a
    TPU topology from a CPU process), else the default backend's."""
    try:
        from jax._src import mesh as mesh_src  # no public accessor for the concrete mesh in jax 0.10

        mesh = mesh_src.get_concrete_mesh()
        if mesh is not None and not mesh.empty:
            return mesh.devices.flat[0].platform
    except (ImportError, AttributeError):
        pass
    return jax.devices()[0].platform

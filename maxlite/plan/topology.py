"""TPU chips and topologies: the published figures per chip, names like `v6e:4x4`, and AOT devices.

Chip figures (per chip; "bidirectional" ICI as Google publishes it):
  v4   Cloud TPU docs "TPU v4" (32 GiB HBM2, 1200 GB/s, 275 TFLOP/s bf16); ICI 6 links × 45 GB/s
       each way from "How to Scale Your Model" (Austin et al., 2025), DCN assumed like v5p.
  v5e  Cloud TPU docs "TPU v5e" (16 GB, 819 GB/s, 197 TFLOP/s, ICI 400 GB/s over 4 ports,
       2 × 100 Gb/s NICs per 8-chip host → 3.1 GB/s DCN per chip).
  v5p  Cloud TPU docs "TPU v5p" (95 GiB, 2765 GB/s, 459 TFLOP/s, ICI 1200 GB/s over 6 ports,
       DCN 50 Gb/s per chip).
  v6e  Cloud TPU docs "TPU v6e" (32 GB, 1638 GB/s, 918 TFLOP/s, ICI 800 GB/s over 4 ports);
       DCN assumed 4 × 200 Gb/s NICs per 8-chip host → 12.5 GB/s per chip.
  tpu7x (Ironwood) Cloud TPU docs "TPU7x (Ironwood)" (per chip: 192 GiB, 7380 GB/s, 2307 TFLOP/s bf16,
       4614 fp8, ICI 1200 GB/s bidirectional, DCN 100 Gb/s; 3D torus like v5p, so 6 ports assumed).
       Each chip is two JAX devices (one per TensorCore, no megacore mode in libtpu), so its entry
       holds HALF of each figure: a Chip's figures are per JAX device, the unit of every plan.
Int8 and fp8 peaks (quantized matmuls): maxlite/chips.py, with their sources; none of these chips
has fp8 matrix units, so fp8 runs at the bf16 peak.
HBM "GB" in the docs is GiB in practice (libtpu reports 31.25 GiB usable of a v6e's 32 GiB).
The compiler, not this table, decides whether a program fits: libtpu knows the usable HBM. The table feeds the report and the step-time estimate only.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from maxlite.chips import peak_tflops

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str              # as in topology names: v4, v5e, v5p, v6e
    hbm_bytes: float       # HBM capacity per chip
    peak_tflops: float     # dense bf16 peak per chip
    hbm_gbps: float        # HBM bandwidth, GB/s
    ici_gbps: float        # bidirectional ICI bandwidth per chip, GB/s
    ici_ports: int         # ICI links per chip (4: 2D torus, 6: 3D torus)
    dcn_gbps: float        # data-centre network bandwidth per chip, GB/s (cross-slice traffic)
    dims: int              # topology dimensions: 2 (AxB) or 3 (AxBxC)
    megacore: bool         # one JAX device per chip spanning both TensorCores
    peak_tflops_int8: float = 0.0  # dense int8 peak per chip (maxlite/chips.py)
    peak_tflops_fp8: float = 0.0   # dense fp8 peak per chip: the bf16 one where XLA converts fp8
    devices_per_chip: int = 1      # JAX devices per chip (Ironwood: 2); the figures above are per device

    def peak(self, precision: str) -> float:
        """The dense peak of matmuls in `precision` (bf16, int8, fp8)."""
        return {"bf16": self.peak_tflops, "int8": self.peak_tflops_int8, "fp8": self.peak_tflops_fp8}[precision]

    @property
    def ring_gbps(self) -> float:
        """A collective along one mesh axis runs on a ring: two ports, each way at half their bidirectional rate."""
        return self.ici_gbps / self.ici_ports


def _chip(name: str, published: str, *figures, devices_per_chip: int = 1) -> Chip:
    return Chip(name, figures[0], peak_tflops(published), *figures[1:],
                peak_tflops_int8=peak_tflops(published, "int8"), peak_tflops_fp8=peak_tflops(published, "fp8"),
                devices_per_chip=devices_per_chip)


CHIPS: dict[str, Chip] = {
    "v4": _chip("v4", "TPU v4", 32 * GIB, 1200.0, 540.0, 6, 6.25, 3, True),
    "v5e": _chip("v5e", "TPU v5e", 16 * GIB, 819.0, 400.0, 4, 3.125, 2, False),
    "v5p": _chip("v5p", "TPU v5p", 95 * GIB, 2765.0, 1200.0, 6, 6.25, 3, True),
    "v6e": _chip("v6e", "TPU v6e", 32 * GIB, 1638.0, 800.0, 4, 12.5, 2, False),
    "tpu7x": _chip("tpu7x", "TPU7x", 96 * GIB, 3690.0, 600.0, 6, 6.25, 3, False, devices_per_chip=2),
}

# Slice shapes offered for each chip family, smallest first (the "bigger topology" ladder).
LADDER: dict[str, tuple[str, ...]] = {
    "v4": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"),
    "v5e": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"),
    "v6e": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "tpu7x": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"),
}

_NAME = re.compile(r"^(v4|v5e|v5p|v6e|tpu7x):(\d+(?:x\d+){1,2})$")


class TopologyError(ValueError):
    """A topology the planner cannot use: one line for the user."""


@dataclasses.dataclass(frozen=True)
class Topology:
    chip: Chip
    shape: str            # e.g. "4x4"
    num_slices: int = 1

    @property
    def name(self) -> str:
        return f"{self.chip.name}:{self.shape}"

    @property
    def chips_per_slice(self) -> int:
        return math.prod(int(x) for x in self.shape.split("x"))

    @property
    def num_chips(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def devices_per_slice(self) -> int:
        return self.chips_per_slice * self.chip.devices_per_chip

    @property
    def num_devices(self) -> int:
        """JAX devices: what the mesh is made of and what every per-device figure divides by."""
        return self.num_chips * self.chip.devices_per_chip

    def describe(self) -> str:
        slices = f" × {self.num_slices} slices" if self.num_slices > 1 else ""
        return f"{self.name}{slices} ({self.num_chips} chips)"


def parse(name: str, num_slices: int = 1) -> Topology:
    """`v6e:4x4` → Topology; `v6e-16` and GPU names get a one-line hint."""
    name = name.strip().lower()
    if num_slices < 1:
        raise TopologyError(f"--num-slices {num_slices}: must be 1 or more")
    m = _NAME.match(name)
    if m:
        chip = CHIPS[m.group(1)]
        if len(m.group(2).split("x")) != chip.dims:
            example = "2x2x1" if chip.dims == 3 else "4x4"
            raise TopologyError(f"topology '{name}': {chip.name} slices have {chip.dims} dimensions, "
                                f"e.g. {chip.name}:{example}")
        return Topology(chip, m.group(2), num_slices)
    if re.match(r"^(h100|h200|a100|b200|gpu|cuda|nvidia)", name):
        raise TopologyError(f"topology '{name}': only TPU topologies are planned (JAX cannot compile "
                            f"for a GPU that is not present); try e.g. v6e:4x4")
    legacy = re.match(r"^(v4|v5e|v5p|v5litepod|v6e|tpu7x)-(\d+)$", name)
    if legacy:
        chip, n = legacy.group(1).replace("v5litepod", "v5e"), int(legacy.group(2))
        if chip in ("v4", "v5p", "tpu7x"):
            n //= 2  # v4-N / v5p-N / tpu7x-N count TensorCores, two per chip
        shapes = [s for s in LADDER[chip] if math.prod(int(x) for x in s.split("x")) == n]
        hint = f"{chip}:{shapes[0]}" if shapes else f"{chip}:4x4"
        raise TopologyError(f"topology '{name}': name the chip and its slice shape, e.g. {hint}")
    raise TopologyError(f"topology '{name}' is not understood; use <chip>:<shape> with chip one of "
                        f"{', '.join(CHIPS)}, e.g. v6e:4x4, v5e:2x2, v5p:4x4x4, v4:2x2x1")


def bigger(topology: Topology) -> list[Topology]:
    """The same chip family, larger slices then more slices of the largest: the 'more chips' ladder."""
    ladder = LADDER[topology.chip.name]
    out = [Topology(topology.chip, s, topology.num_slices) for s in ladder
           if math.prod(int(x) for x in s.split("x")) * topology.num_slices > topology.num_chips]
    largest = ladder[-1]
    slices = topology.num_slices if topology.shape == largest else 1
    while len(out) < 12:
        slices *= 2
        out.append(Topology(topology.chip, largest, slices))
    return out


_LIBTPU_HINT = "planning for TPU needs libtpu: pip install 'maxlite[tpu]'"


def require_libtpu() -> None:
    try:
        import libtpu  # noqa: F401  (the TPU compiler; no TPU needed)
    except ImportError:
        raise TopologyError(_LIBTPU_HINT) from None


def quiet_libtpu_env(topology: Topology) -> None:
    """libtpu probes GCE metadata and warns at start-up unless told it is not on a TPU VM."""
    n = topology.chips_per_slice * (2 if topology.chip.megacore else topology.chip.devices_per_chip)  # TensorCores
    defaults = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": f"{topology.chip.name}-{n}",
                "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
                # no TPU is opened, so several planners (or tests) may load libtpu at once
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never try to open a real accelerator


def devices(topology: Topology) -> list:
    """The topology's devices (not backed by hardware): enough to build a mesh and compile."""
    require_libtpu()
    quiet_libtpu_env(topology)
    from jax.experimental import topologies

    kwargs = {"chip_config_name": "megacore"} if topology.chip.megacore else {}
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology.name,
                                            num_slices=topology.num_slices, **kwargs)
    except Exception as e:  # libtpu: INVALID_ARGUMENT ... (one line is enough)
        msg = str(e).splitlines()[0].split("INVALID_ARGUMENT: ")[-1]
        raise TopologyError(f"topology '{topology.name}': {msg}") from None
    return list(desc.devices)

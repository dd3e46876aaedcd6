"""maxlite's checkpoint checksums against the checksum zarr v3 has built in → benchmarks/results/
checkpoint_checksum_codec_<model>.json.

    python benchmarks/bench_checksum_codec.py [--model llama-100m] [--repeats 11] [--dir /dev/shm]

The other way to checksum every byte (issue 53, item 6: "verify while reading, the bytes pass
through the CPU once"): zarr v3's `crc32c` codec, which tensorstore computes as it encodes each
chunk and checks as it decodes it, inside its own threads. Orbax 0.12 offers no knob for a chunk
codec, so this script appends `{"name": "crc32c"}` to the chunk codecs Orbax builds
(`tensorstore_utils._build_zarr3_metadata`) for that arm only. Three arms, a trained state saved
synchronously and restored (onto the run's shardings) in rotating order in every repeat, each timed
section after `os.sync()`:

- `plain`: no checksums (`Checkpointer(checksums=False)`, `restore_items(verify=False)`);
- `codec`: tensorstore's per-chunk CRC32C, no maxlite record (its restore checks every chunk it reads);
- `ours`: maxlite's record (maxlite/checkpoints/checksums.py), checked on restore.

Wall seconds and this process's user and system CPU seconds, medians. `--dir /dev/shm` (memory)
takes the disk's ±50% out of the wall times and is where a checksum's share is largest.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402

from benchmarks._results import cpuinfo, write_result  # noqa: E402
from bench_checkpoint import _Data, trained_state  # noqa: E402
from maxlite import checkpoints as ck, config as C, state as state_lib  # noqa: E402
from maxlite.build import build  # noqa: E402
from maxlite.checkpoints.saver import Checkpointer  # noqa: E402

ARMS = ("plain", "codec", "ours")


def with_codec() -> list[bool]:
    """A switch ([False]) that, set, adds the crc32c codec to the chunks of every zarr3 array Orbax writes."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils  # pinned: orbax <0.13

    on, build_metadata = [False], ts_utils._build_zarr3_metadata

    def metadata(*args, **kwargs):
        m = build_metadata(*args, **kwargs)
        if on[0]:
            m["codecs"][0]["configuration"]["codecs"].append({"name": "crc32c"})
        return m
    ts_utils._build_zarr3_metadata = metadata
    return on


def timed(fn) -> tuple[float, float, float]:
    """(wall, user CPU, system CPU) seconds of fn(), after os.sync()."""
    os.sync()
    t, u = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    fn()
    v = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter() - t, v.ru_utime - u.ru_utime, v.ru_stime - u.ru_stime


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-100m")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp)")
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args()
    codec = with_codec()
    where = tempfile.mkdtemp(prefix="bench-ckpt-codec-", dir=args.dir)
    argv = ["base.yml", f"model_name={args.model}", f"base_output_directory={where}", "run_name=bench",
            "max_num_checkpoints_to_keep=0", "async_checkpointing=false"]
    built = build(C.load(argv))
    abstract, shardings = built.abstract, built.shardings
    state = trained_state(built.init_state(), built.tx, shardings)
    jax.block_until_ready(state)
    nbytes = state_lib.nbytes(abstract)
    savers = {arm: Checkpointer(C.resolve(C.load([*argv, f"run_name={arm}"]), jax.device_count()), True, nbytes,
                                checksums=arm == "ours") for arm in ARMS}
    for arm, saver in savers.items():  # the first save of each (thread pools, metadata) untimed
        codec[0] = arm == "codec"
        saver.save(1, state, _Data())
    samples = {f"{op}_{arm}": [] for op in ("save", "restore") for arm in ARMS}
    for r in range(args.repeats):
        for arm in ARMS[r % 3:] + ARMS[:r % 3]:
            codec[0] = arm == "codec"
            samples[f"save_{arm}"].append(timed(lambda: savers[arm].save(r + 2, state, _Data())))
            shutil.rmtree(f"{savers[arm].path}/{r + 1}", ignore_errors=True)  # untimed: two steps on disk
        print(f"save repeat {r + 1}: " + ", ".join(f"{a} {samples[f'save_{a}'][-1][0]:.3f} s" for a in ARMS),
              flush=True)
    targets = {"params": ck.sharded_target(abstract.params, shardings.params),
               "optimizer": ck.sharded_target({"step": abstract.step, "opt_state": abstract.opt_state},
                                              {"step": shardings.step, "opt_state": shardings.opt_state})}
    for r in range(args.repeats):
        for arm in ARMS[r % 3:] + ARMS[:r % 3]:
            def restore():
                jax.block_until_ready(ck.restore_items(savers[arm].path, args.repeats + 1, targets,
                                                       verify=arm == "ours"))
            samples[f"restore_{arm}"].append(timed(restore))
        print(f"restore repeat {r + 1}: " + ", ".join(f"{a} {samples[f'restore_{a}'][-1][0]:.3f} s" for a in ARMS),
              flush=True)
    for saver in savers.values():
        saver.close()
    shutil.rmtree(where, ignore_errors=True)
    med = {k: {"wall": statistics.median(s[0] for s in v), "user_cpu": statistics.median(s[1] for s in v),
               "system_cpu": statistics.median(s[2] for s in v)} for k, v in samples.items()}
    cost = {f"{op}_{arm}": {m: med[f"{op}_{arm}"][m] / med[f"{op}_plain"][m] - 1 for m in ("wall", "user_cpu")}
            for op in ("save", "restore") for arm in ("codec", "ours")}
    write_result({"model": args.model, "state_bytes": nbytes, "devices": jax.device_count(), "repeats": args.repeats,
                  "storage": "memory (tmpfs)" if str(args.dir or "").startswith("/dev/shm") else "local disk",
                  "cpu_model": cpuinfo("model name"), "cpu_count": os.cpu_count(),
                  "load_average_at_end": os.getloadavg()[:2], "median": med, "cost_over_plain": cost,
                  "cost_is": "median with / median of plain - 1, per measure",
                  "samples_wall_user_system": samples},
                 args.out or ROOT / "benchmarks" / "results" / f"checkpoint_checksum_codec_{args.model}.json")


if __name__ == "__main__":
    main()

"""JAX's persistent compilation cache: a re-run of the same recipe loads its compiled programs."""

from __future__ import annotations


def enable_compilation_cache(cfg) -> str:
    """Turn the cache on under cfg.jax_cache_dir (resolved with the config; "" leaves it off)."""
    if not cfg.jax_cache_dir:
        return ""
    import jax

    path = cfg.jax_cache_dir
    jax.config.update("jax_compilation_cache_dir", path)
    # cache every program: the step's init and the small jits add up on the first step too
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _one_key_for_every_cpu_process()
    return path


def _one_key_for_every_cpu_process() -> None:
    """Several CPU processes (gloo): JAX keys a program by the topology of the devices it runs on, and
    each process describes the CPU topology with its own fingerprint, so only process 0 (the one JAX
    lets write) ever found its programs again: every other process compiled every program on every
    run and restart, and process 0 waited for it at the first collective (tiny, 2 processes: 27 s of a
    re-run's 32). Those devices are keyed by their global ids and processes instead, the same on every
    process; the program is the same SPMD program on all of them (JAX itself drops the device
    assignment from the key for GPU processes for the same reason). TPU and GPU keys are unchanged."""
    from jax._src import cache_key

    topology_key = cache_key._hash_accelerator_config
    if getattr(topology_key, "maxlite", False):
        return

    def key(hash_obj, devices):
        flat = list(devices.flat)
        if flat and flat[0].platform == "cpu" and len({d.process_index for d in flat}) > 1:
            for d in flat:
                cache_key._hash_string(hash_obj, f"{d.id}:{d.process_index}:{d.device_kind}")
        else:
            topology_key(hash_obj, devices)

    key.maxlite = True
    cache_key._hash_accelerator_config = key

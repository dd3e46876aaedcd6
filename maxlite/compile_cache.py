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
    return path

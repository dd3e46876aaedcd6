"""Which mixer kinds' decode caches the rollout engine can page (maxlite/models/paged_cache.py):
JAX-free, so the recipe check refuses `rollout_paged_kv` for the rest before any work."""

from __future__ import annotations

# caches that grow per position: a pool of blocks; fixed-size per-sequence states: kept per slot
PAGED = ("attention", "mla", "dsa")
PER_SLOT = ("gated_deltanet", "kda", "mamba2", "none")


def refusal(kinds) -> str | None:
    """The one line saying why a model with these mixer kinds cannot run paged, or None."""
    other = sorted(set(kinds) - set(PAGED) - set(PER_SLOT))
    if other:
        return (f"rollout_paged_kv=true: mixer kind(s) {', '.join(other)} have no paged cache yet "
                "(Gemma 4's shared K/V); set rollout_paged_kv=false")
    return None

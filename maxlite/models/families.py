"""The registry of model families (`decoder_block` → maxlite.families.Family): what differs between
them, said once, each family in its own package of maxlite/families/.

The transformer, the layers, the FLOP count, the planner, decoding, the torch twin, the HF adapters
and the NeMo/Megatron mapping read these traits instead of testing the family's name. Which mixer and
feed-forward kind each layer has is maxlite/models/layout.py's.

Pure data: importable without JAX, and without the bridge (config validation reads it; a family's HF
adapter, `Family.hf_module`, is imported only by a conversion).
"""

from __future__ import annotations

import collections.abc

from maxlite.families import Family

SWIGLU_ALPHA = 1.702  # the sigmoid gain of the "clamped_swiglu" MLP (gpt-oss's)


class _Registry(collections.abc.Mapping):
    """The families by name: one per package of maxlite/families/ (its __init__ defines FAMILY, its
    data; the HF adapter beside it is not imported), found when first read."""

    def __init__(self):
        self._all = None

    def _load(self) -> dict:
        if self._all is None:
            import importlib
            import pkgutil

            from maxlite import families as package
            found = {}
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
                if info.ispkg:
                    fam = importlib.import_module(f"{package.__name__}.{info.name}").FAMILY
                    found[fam.name] = fam
            self._all = found
        return self._all

    def __getitem__(self, name: str) -> Family:
        return self._load()[name]

    def __iter__(self):
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


FAMILIES = _Registry()


def family(cfg) -> Family:
    """The family of a config (its `decoder_block`; config validation keeps it one of FAMILIES)."""
    return FAMILIES[cfg.decoder_block]


def has_qk_norm(cfg) -> bool:
    """q and k RMS-normed before RoPE with a learned scale: the family's own norms, or the recipe's
    use_qk_norm (per head; a family with `qk_l2_norm` reads use_qk_norm as its scaleless norm instead)."""
    fam = family(cfg)
    return fam.qk_norm or (cfg.use_qk_norm and not fam.qk_l2_norm)

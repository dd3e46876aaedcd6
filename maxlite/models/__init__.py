"""Llama-family and GPT-3-style decoders in Flax NNX; FLOP and parameter accounting.

`families` is pure data (config validation reads it without JAX); `Transformer` loads on first use.
"""

__all__ = ["Transformer"]


def __getattr__(name):
    if name == "Transformer":
        from maxlite.models.transformer import Transformer
        return Transformer
    raise AttributeError(name)

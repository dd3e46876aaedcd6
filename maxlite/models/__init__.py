"""Llama-family and GPT-3-style decoders in Flax NNX; FLOP and parameter accounting."""

from maxlite.models.transformer import Transformer

__all__ = ["Transformer"]

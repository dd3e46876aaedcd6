"""Gemma 4's mixture-of-experts variant (26B-A4B; `enable_moe_block` in config.json): gemma4's layers
whose feed-forward is a dense GeGLU MLP beside routed experts (maxlite/models/gemma4.py `MoEBlock`).
Its HF adapter is gemma4's (maxlite/families/gemma4/hf.py), which imports such a checkpoint as this family.
"""

from __future__ import annotations

import dataclasses

from maxlite.families import gemma4

FAMILY = dataclasses.replace(
    gemma4.FAMILY, name="gemma4_moe", hf_model_types=(), moe=True,
    summary="Gemma 4 MoE (text): gemma4's layers with a dense MLP beside top-k routed GeGLU experts")

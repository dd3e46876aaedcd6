"""The model's name tables, without JAX: config validation, the planner and the reports read them.

`attention`, `moe_implementation`, `remat_policy` and `quantization` name implementations whose code
lives in attention.py, moe.py and transformer.py (which check their tables against these names);
`resolve_attention` and `resolve_moe` are THE rules that turn `autoselected` into the implementation
that runs — resolved once, where the config is resolved against its devices
(maxlite.config.resolve), so the model, the planner, the benchmarks and status.json all name the
same one.
"""

from __future__ import annotations

ATTENTION = ("autoselected", "dot_product", "blockwise", "flash", "cudnn_flash")
REMAT_POLICIES = ("none", "full", "minimal", "save_dots", "save_qkv_proj", "save_dot_except_mlp",
                  "save_attn_mlp_proj", "offload_layer_inputs")
QUANTIZATION = ("", "int8", "fp8", "fp8_full", "fp8_gpu")  # MaxText's values; maxlite/quant.py runs them
BLOCKWISE_MIN_LENGTH = 2048  # on CPU, dot_product's T×T scores cost more than blocking saves below this
# the vision encoder kinds whose image tokens attend to each other both ways in the decoder (Gemma 3:
# a run of placeholders is one block, seen whole by each of its tokens); dot_product alone draws that mask
BIDIRECTIONAL_ENCODERS = ("siglip",)
# the shape keys an encoder kind cannot do without (0: unset), checked when a recipe is loaded
VISION_KEYS = {"gemma4_vit": ("vision_num_layers", "vision_emb_dim", "vision_mlp_dim", "vision_num_heads",
                              "vision_tokens_per_image", "vision_num_positions")}
IMAGE_BLOCK_ATTENTION = ("dot_product", "blockwise")  # the two that draw bidirectional image blocks


def image_blocks(cfg) -> bool:
    """Whether the decoder's attention sees each image's tokens both ways: the encoder kind says
    (siglip), or the recipe (gemma4_vit with vision_bidirectional: its sliding-window layers)."""
    return cfg.vision_encoder in BIDIRECTIONAL_ENCODERS or (cfg.vision_encoder == "gemma4_vit"
                                                           and cfg.vision_bidirectional)


CUDNN_DTYPES = ("bfloat16",)  # the compute dtypes cuDNN's fused attention takes (of `dtype`'s choices)


def resolve_attention(name: str, platform: str, seq_len: int, block_size: int, splash_block_q: int,
                      pieces: int = 1, sinks: bool = False, image_blocks: bool = False,
                      dtype: str = "bfloat16") -> str:
    """The implementation `name` stands for on `platform` (cpu | gpu | tpu) at sequence length
    `seq_len`: `autoselected` is flash on TPU, cudnn_flash on GPU, blockwise on CPU from
    BLOCKWISE_MIN_LENGTH on, else dot_product — and dot_product where the chosen kernel's blocks
    (attention_block_size, sa_block_q) do not tile the sequence, or each of its `pieces` chunks
    (context parallelism: maxlite.models.context). A named one is itself, except cudnn_flash with
    attention sinks (`sinks`): JAX's cuDNN call takes none, so blockwise runs (dot_product where its
    blocks do not tile). With bidirectional image blocks (`image_blocks`) `autoselected` is chosen as on a
    CPU on every platform: the kernels cannot draw them, XLA's two can (config_checks refuses another
    named one). cuDNN's fused attention takes 16-bit inputs only: with a float32 compute `dtype` a GPU's
    `autoselected` is chosen as on a CPU (config_checks refuses cudnn_flash by name)."""
    if image_blocks and name == "autoselected":
        if seq_len < BLOCKWISE_MIN_LENGTH:
            return "dot_product"
        chosen, block = "blockwise", block_size
    elif sinks and (name == "cudnn_flash" or name == "autoselected" and platform == "gpu"):
        chosen, block = "blockwise", block_size
    elif name != "autoselected":
        return name
    elif platform == "tpu":
        chosen, block = "flash", splash_block_q
    elif platform == "gpu" and dtype in CUDNN_DTYPES:
        return "cudnn_flash"
    elif seq_len >= BLOCKWISE_MIN_LENGTH:
        chosen, block = "blockwise", block_size
    else:
        return "dot_product"
    chunk = seq_len // pieces
    return chosen if seq_len % pieces == 0 and chunk % min(block, chunk) == 0 else "dot_product"


MOE_IMPLEMENTATIONS = ("autoselected", "dense", "ragged", "blocked", "megablox", "capacity")


def resolve_moe(name: str, platform: str, capacity_factor: float) -> str:
    """The expert implementation `name` stands for on `platform`: `autoselected` is capacity when
    tokens may be dropped (capacity_factor > 0), else dropless: megablox (the Pallas grouped matmul)
    on TPU, ragged (XLA's ragged_dot) on GPU, blocked on CPU, whose XLA runs ragged_dot 10-400x
    slower than a dense matmul of the same work (docs/moe.md). A named one is itself."""
    if name != "autoselected":
        return name
    if capacity_factor > 0:
        return "capacity"
    return {"tpu": "megablox", "gpu": "ragged"}.get(platform, "blocked")

"""Each mixer and feed-forward kind's recipe checks, named by its entry in maxlite/models/kinds.py
(`checks`: before any device count; `layout_checks`: once `config.resolve` has filled the mesh).

A check is `(cfg, used) → the one line saying what is wrong and how to fix it, or None`. `used`: a
layer of the recipe has a kind naming the check. Kinds that share keys name the same check (the two
mixtures of experts; Gemma 4's attention kinds), which then also refuses those keys on a model that
has none of them. maxlite/config_checks.py runs them (`kinds.check_kinds`) and raises ConfigError.

Pure Python: config validation imports it, never JAX.
"""

from __future__ import annotations

from maxlite.models import lora_targets
from maxlite.models.families import FAMILIES
from maxlite.models.layout import pattern_mixers

# what Gemma 4's kinds read (maxlite/models/gemma4.py), each with the value that leaves it unused
GEMMA4_KEYS = (("global_head_dim", 0), ("global_num_kv_heads", 0), ("attention_k_eq_v", False),
               ("global_rope_fraction", 1.0), ("num_kv_shared_layers", 0), ("use_double_wide_mlp", False))


def moe(c, used: bool) -> str | None:
    """The mixture-of-experts keys (maxlite/models/moe.py), refused on a model whose MLPs are dense."""
    if not used:
        if c.num_experts or c.mlp_bias or c.router_logit_bias:
            families = ", ".join(f.name for f in FAMILIES.values() if f.moe)
            return (f"num_experts={c.num_experts}, mlp_bias={c.mlp_bias}, router_logit_bias={c.router_logit_bias}: "
                    f"decoder_block={c.decoder_block} has a dense MLP; mixtures of experts are the families {families}")
        return None
    if c.num_experts < 1 or c.base_moe_mlp_dim < 1:
        return (f"decoder_block={c.decoder_block} needs num_experts and base_moe_mlp_dim > 0, got "
                f"{c.num_experts} and {c.base_moe_mlp_dim}")
    if not 1 <= c.num_experts_per_tok <= c.num_experts:
        return f"num_experts_per_tok={c.num_experts_per_tok} must be in [1, num_experts={c.num_experts}]"
    if c.shared_experts < 0:
        return f"shared_experts={c.shared_experts} must be >= 0"
    if c.ragged_buffer_factor <= 0 and c.ragged_buffer_factor != -1:
        return f"ragged_buffer_factor={c.ragged_buffer_factor}: -1 (every sender's rows) or > 0"
    if c.capacity_factor <= 0 and c.capacity_factor != -1:
        return f"capacity_factor={c.capacity_factor}: -1 (dropless) or > 0"
    if c.moe_implementation == "capacity" and c.capacity_factor <= 0:
        return ("moe_implementation=capacity drops what exceeds an expert's capacity: set "
                "capacity_factor > 0 (e.g. 1.25), or pick a dropless implementation")
    if c.load_balance_loss_weight < 0 or c.router_z_loss_weight < 0:
        return "load_balance_loss_weight and router_z_loss_weight must be >= 0"
    if c.routed_bias_update_rate and not c.routed_bias:
        return f"routed_bias_update_rate={c.routed_bias_update_rate} moves the routing bias: set routed_bias=true"
    mlp = [t for t in c.lora_targets if t in lora_targets.MLP_TARGETS] if c.lora_rank else []
    if mlp:
        return (f"lora_rank={c.lora_rank} on a mixture of experts adapts the attention projections only "
                f"(experts and router take no adapters): drop {', '.join(mlp)} from lora_targets")
    if c.routed_weight_on_input and c.num_experts_per_tok != 1:
        return (f"routed_weight_on_input=true with num_experts_per_tok={c.num_experts_per_tok}: the router's "
                f"weight scales the expert's input for one expert per token only (Llama 4's): "
                f"set num_experts_per_tok=1")
    return _routing_groups(c)


def _chunked_layers(c, used: bool) -> bool:
    """Whether an attention layer is of the chunked variant."""
    return used and any(variant == "chunked" for _, variant in pattern_mixers(c))


def chunked(c, used: bool) -> str | None:
    """Chunked-attention layers: a chunk, an attention implementation that takes them through its
    segment mask (not cuDNN's packed layout), no sliding window beside it (the local flag of a layer is
    one or the other); the key refused where no layer is chunked."""
    if not _chunked_layers(c, used):
        if c.chunk_attn_window_size:
            return (f"chunk_attn_window_size={c.chunk_attn_window_size}: no layer of decoder_block={c.decoder_block} "
                    f"is chunked (layer_types chunked_attention; the llama4 family's pattern)")
        return None
    if c.chunk_attn_window_size < 1:
        return "layers of variant chunked (chunked_attention) need chunk_attn_window_size > 0"
    if c.sliding_window:
        return (f"chunk_attn_window_size={c.chunk_attn_window_size} with sliding_window={c.sliding_window}: a "
                f"model's local layers are chunked or sliding-window, not both (set sliding_window=0)")
    if c.attention == "cudnn_flash":
        return (f"attention={c.attention}: cuDNN's packed layout counts documents, not the chunks of "
                f"chunked-attention layers: set attention=blockwise, dot_product, flash or autoselected")
    return None


def chunked_layout(c, used: bool) -> str | None:
    """Context parallelism does not split chunked-attention layers (their chunks follow each document's
    positions, which a shard's queries do not carry yet)."""
    if _chunked_layers(c, used) and c.axis_size("context") > 1:
        return (f"context parallelism (context={c.axis_size('context')}) does not split chunked-attention layers: "
                f"set ici_context_parallelism=1 (and dcn_context_parallelism=1)")
    return None


def _routing_groups(c) -> str | None:
    """Group-limited routing: both keys or neither; equal groups holding at least the top k."""
    G, top = c.n_routing_groups, c.topk_routing_group
    if G == -1 and top == -1:
        return None
    E = c.num_experts
    if G < 1 or E % G or not 1 <= top <= G:
        return (f"n_routing_groups={G}, topk_routing_group={top}: the groups must divide num_experts={E} and "
                f"1 <= topk_routing_group <= n_routing_groups (-1, -1: no groups)")
    if c.routed_score_func == "sigmoid" and E // G < 2:
        return (f"n_routing_groups={G}: a group's score is the sum of its best 2 experts, so each group needs 2 "
                f"of the num_experts={E}")
    if top * (E // G) < c.num_experts_per_tok:
        return (f"topk_routing_group={top} groups of {E // G} experts hold fewer than "
                f"num_experts_per_tok={c.num_experts_per_tok}")
    return None


def moe_layout(c, used: bool) -> str | None:
    """The expert axis splits the experts (a dense model has none to split) and takes whole sequences."""
    expert, tensor, context = (c.axis_size(a) for a in ("expert", "tensor", "context"))
    if expert > 1 and (not used or c.num_experts % expert):
        return (f"expert parallelism {expert} splits the experts: num_experts={c.num_experts} must be a multiple "
                f"of it (a dense model has none; use ici_expert_parallelism=1)")
    if used and c.base_moe_mlp_dim % tensor:
        return f"base_moe_mlp_dim={c.base_moe_mlp_dim} is not divisible by tensor parallelism {tensor}"
    if context > 1 and expert > 1:
        return (f"context parallelism {context} with expert parallelism {expert} is not supported yet: the "
                f"experts' token exchange takes whole sequences; use one of the two")
    return None


def mla(c, used: bool) -> str | None:
    """Latent attention (maxlite/models/mla.py): RoPE over an even width."""
    if used and c.qk_rope_head_dim % 2:
        return f"qk_rope_head_dim={c.qk_rope_head_dim}: RoPE rotates pairs of dims, make it even"
    return None


def _not_split_over_context(c, used: bool, what: str) -> str | None:
    """The one line refusing context parallelism for layers that read the whole sequence (`what`)."""
    context = c.axis_size("context")
    if used and context > 1:
        return (f"context parallelism (context={context}) does not split {what} "
                f"({c.decoder_block}): set ici_context_parallelism=1 (and dcn_context_parallelism=1)")
    return None


def dsa(c, used: bool) -> str | None:
    """DeepSeek sparse attention (maxlite/models/dsa.py): the indexer's queries come from the query
    latent, and RoPE covers the first qk_rope_head_dim dims of its heads; its dense warm-up trains the
    indexer alone."""
    if c.index_stage == "dense_warmup" and not used:
        return (f"index_stage=dense_warmup trains DeepSeek sparse attention's indexer: decoder_block={c.decoder_block} "
                f"has none (deepseek_v32 and glm_moe_dsa have)")
    if c.index_stage == "dense_warmup" and c.lora_rank:
        return (f"index_stage=dense_warmup trains the indexer alone, lora_rank={c.lora_rank} trains adapters alone: "
                f"set lora_rank=0 for the warm-up")
    if used and not c.q_lora_rank:
        return "DeepSeek sparse attention's indexer reads the query latent: set q_lora_rank > 0"
    if used and c.index_head_dim < c.qk_rope_head_dim:
        return (f"index_head_dim={c.index_head_dim} must be at least qk_rope_head_dim={c.qk_rope_head_dim} "
                f"(the indexer rotates that many of its dims)")
    return None


def dsa_layout(c, used: bool) -> str | None:
    """Each query's choice reads every earlier token: not split over context shards."""
    return _not_split_over_context(c, used, "DeepSeek sparse attention's indexer")


def gated_deltanet_layout(c, used: bool) -> str | None:
    """The recurrence runs along the whole sequence: its state would have to cross context shards."""
    return _not_split_over_context(c, used, "gated delta-net layers")


def kda(c, used: bool) -> str | None:
    """Kimi delta attention (maxlite/models/kda.py): as many key as value heads, of one width."""
    if used and (c.gdn_num_key_heads != c.gdn_num_value_heads or c.gdn_key_head_dim != c.gdn_value_head_dim):
        return (f"Kimi delta attention has one head shape for q, k and v: set gdn_num_key_heads = gdn_num_value_heads "
                f"({c.gdn_num_key_heads} ≠ {c.gdn_num_value_heads}?) and gdn_key_head_dim = gdn_value_head_dim "
                f"({c.gdn_key_head_dim} ≠ {c.gdn_value_head_dim}?)")
    return None


def mamba2(c, used: bool) -> str | None:
    """Mamba-2 (maxlite/models/mamba2.py): each group of B and C serves whole heads."""
    if used and c.mamba_num_heads % c.mamba_num_groups:
        return (f"mamba_num_heads={c.mamba_num_heads} must be a multiple of mamba_num_groups={c.mamba_num_groups} "
                f"(each group of B and C serves whole heads)")
    return None


def mamba2_layout(c, used: bool) -> str | None:
    """The scan runs along the whole sequence: its state would have to cross context shards."""
    return _not_split_over_context(c, used, "Mamba-2 layers")


def gemma4(c, used: bool) -> str | None:
    """Gemma 4's keys (maxlite/models/gemma4.py), refused on another family's layers; its own RoPE."""
    if not used:
        shaping = [k for k, off in GEMMA4_KEYS if getattr(c, k) != off]
        if shaping:
            return f"{shaping[0]} shapes Gemma 4's layers (decoder_block=gemma4), not {c.decoder_block}'s"
        return None
    if c.partial_rotary_factor != 1.0 or c.rope_scaling_factor > 0:
        return (f"decoder_block={c.decoder_block} has its own RoPE (default on sliding-window layers, proportional "
                f"by global_rope_fraction on global ones): leave partial_rotary_factor and rope_scaling_factor unset")
    if c.use_double_wide_mlp and c.num_experts:
        return "use_double_wide_mlp widens dense MLPs, not a mixture of experts' (gemma4_moe)"
    return None


def kv_sharing(c, used: bool) -> str | None:
    """The last num_kv_shared_layers layers reuse keys and values: each needs an earlier layer of its
    kind (variant) that computes its own."""
    n = c.num_kv_shared_layers
    if not used:  # no layer shares (num_kv_shared_layers=0), or Gemma 4's keys were refused already
        return None
    if n >= c.base_num_decoder_layers:
        return f"num_kv_shared_layers={n}: at least one layer must compute keys and values"
    variants = [v for _, v in pattern_mixers(c)]
    first = len(variants) - n
    missing = sorted(set(variants[first:]) - set(variants[:first]))
    if missing:
        return (f"num_kv_shared_layers={n}: no layer before the sharing ones is {missing[0]} (a shared layer reuses "
                f"the last earlier layer of its kind)")
    return None


def v4(c, used: bool) -> str | None:
    """DeepSeek-V4's attention (maxlite/models/v4_attention.py): grouped output heads, a query latent."""
    if not used:
        return None
    if not c.o_groups or (c.base_num_query_heads * c.head_dim) % c.o_groups:
        return (f"o_groups={c.o_groups} must divide the heads' width base_num_query_heads × head_dim = "
                f"{c.base_num_query_heads * c.head_dim} (DeepSeek-V4's grouped output projection)")
    if not c.q_lora_rank or c.qk_rope_head_dim % 2 or c.qk_rope_head_dim > c.head_dim:
        return (f"DeepSeek-V4's attention reads a query latent (q_lora_rank > 0, got {c.q_lora_rank}) and rotates "
                f"an even qk_rope_head_dim ≤ head_dim (got {c.qk_rope_head_dim} of {c.head_dim})")
    return None

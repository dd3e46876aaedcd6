"""The model's keys of the recipe (its sections model, mixture of experts, gated delta-net, Mamba-2
and vision encoder): what builds the parameters and the function they compute. Part of the schema
(maxlite/schema.py, whose `Keys` holds these among the others, in this order); a leaf."""

# No `from __future__ import annotations` here: loading reads each field's type as a type (Field.type).
import dataclasses

from maxlite.schema_key import key


@dataclasses.dataclass(frozen=True)
class ModelKeys:
    """The model's sections of `Keys` (those of its keys with `model=True` are MODEL_KEYS)."""

    model_name: str = key("default",
        'preset in configs/models/<model_name>.yml; "default" uses the keys below', section="model")
    decoder_block: str = key("llama2",
        "the family (maxlite/models/families.py): llama2 (RMSNorm, RoPE, SwiGLU, GQA; also llama3/mistral) | "
        "gpt3 (LayerNorm, GELU, learned positions) | qwen2 (q/k/v biases) | qwen3 (q/k norms) | gemma3 (5 "
        "local : 1 global layers, sandwich norms, GeGLU) | olmo3 (post-norms only, 3 local : 1 global; "
        "maxlite/families/olmo3/) | mixtral, qwen3_moe (mixtures of experts: the keys below)", model=True)
    base_emb_dim: int = key(2048, "model width D", positive=True, model=True)
    base_num_decoder_layers: int = key(16, "number of decoder layers L", positive=True, model=True)
    base_num_query_heads: int = key(16, "query heads N", positive=True, model=True)
    base_num_kv_heads: int = key(16, "key/value heads K (grouped-query attention when K < N)", positive=True,
        model=True)
    base_mlp_dim: int = key(7168, "MLP hidden width F", positive=True, model=True)
    head_dim: int = key(128, "per-head width H", positive=True, model=True)
    vocab_size: int = key(32000, "vocabulary size V (must cover every token id in the data)", positive=True, model=True)
    max_position_embeddings: int = key(8192,
        "gpt3: learned position table size; llama2 block: the context length recorded on HF export", model=True)
    rope_max_timescale: int = key(10000, "RoPE base theta", positive=True, model=True)
    rope_scaling_factor: float = key(0.0,
        "RoPE scaling factor of the global layers (rope_scaling_type); 0 disables scaling", model=True)
    rope_scaling_type: str = key("llama3",
        "how rope_scaling_factor scales: llama3 (Llama 3.1's piecewise rule, the factors below) | linear "
        "(positions ÷ factor; Gemma 3) | yarn (YaRN: DeepSeek-V3, gpt-oss, Kimi K2; the keys below)",
        choices=("llama3", "linear", "yarn"), model=True)
    rope_low_freq_factor: float = key(1.0, "Llama 3.1 RoPE scaling low-frequency factor", model=True)
    rope_high_freq_factor: float = key(4.0, "Llama 3.1 RoPE scaling high-frequency factor", model=True)
    rope_original_max_position: int = key(8192,
        "the pre-trained context length the scaling extends (llama3 and yarn)", positive=True, model=True)
    beta_fast: float = key(32.0, "YaRN: rotations below which a frequency is interpolated fully", positive=True,
        model=True)
    beta_slow: float = key(1.0, "YaRN: rotations above which a frequency is kept (extrapolated)", positive=True,
        model=True)
    mscale: float = key(0.0,
        "YaRN: with mscale_all_dim, the attention factor is m(mscale)/m(mscale_all_dim), m(s) = 0.1·s·ln(factor) + 1 "
        "(DeepSeek); 0: m(1)", bounds=(0, None), model=True)
    mscale_all_dim: float = key(0.0, "YaRN: the divisor's scale of the attention factor (see mscale); 0: unset",
        bounds=(0, None), model=True)
    rope_truncate: bool = key(True, "YaRN: round the interpolation ramp's bounds to whole dimensions (gpt-oss: false)",
        model=True)
    rope_attention_factor: float = key(0.0,
        "YaRN: the factor the rotated q and k are multiplied by, when a checkpoint states it; 0: from mscale",
        bounds=(0, None), model=True)
    partial_rotary_factor: float = key(1.0,
        "the fraction of each head's dimensions RoPE rotates (the first ones; GLM-4.5 0.5, Qwen3-Next 0.25); the "
        "rest pass unrotated", bounds=(0, 1), model=True)
    sliding_window: int = key(0,
        'tokens a sliding-window ("local") layer attends to, itself included (Mistral, Gemma 3); which layers '
        "are local is the family's pattern; 0: every layer global", bounds=(0, None), model=True)
    layer_types: tuple[str, ...] = key((),
        "each layer's kind by its HF `layer_types` name (full_attention | sliding_attention), one per layer: a "
        "checkpoint's own pattern (hf import writes it when it differs from the family's); []: the family's "
        "pattern", model=True)
    local_rope_max_timescale: int = key(0,
        "RoPE base theta of the sliding-window layers, unscaled (Gemma 3: 10000); 0: the global layers' RoPE",
        bounds=(0, None), model=True)
    query_pre_attn_scalar: float = key(0.0, "attention scores scaled by this^-0.5 (Gemma 3); 0: head_dim",
        bounds=(0, None), model=True)
    chunk_attn_window_size: int = key(0,
        "chunked attention (Llama 4: 8192; MaxText's key): the layers of variant `chunked` (HF layer_types "
        "chunked_attention) attend only to the earlier tokens of their own chunk of this many positions; "
        "0: none", bounds=(0, None), model=True)
    temperature_tuning: bool = key(False,
        "Llama 4's global (NoPE) layers scale each query at position p by 1 + temperature_tuning_scale · "
        "log(1 + floor((p + 1) / temperature_tuning_floor_scale)) (HF attn_temperature_tuning)", model=True)
    temperature_tuning_scale: float = key(0.1, "temperature tuning: the log term's weight (HF attn_scale)",
        bounds=(0, None), model=True)
    temperature_tuning_floor_scale: float = key(8192.0,
        "temperature tuning: positions per step of the log term (HF floor_scale)", positive=True, model=True)
    global_head_dim: int = key(0,
        "per-head width of the global (full-attention) layers when it differs from head_dim (Gemma 4: 512); "
        "0: head_dim", bounds=(0, None), model=True)
    global_num_kv_heads: int = key(0,
        "key/value heads of the global layers when they differ (Gemma 4 31B: 4); 0: base_num_kv_heads",
        bounds=(0, None), model=True)
    attention_k_eq_v: bool = key(False,
        "global layers compute no value projection: their values are the key projection, normed (Gemma 4)", model=True)
    global_rope_fraction: float = key(1.0,
        "fraction of each global head's RoPE frequencies that rotate, the rest at frequency 0 (Gemma 4's "
        "proportional RoPE: 0.25)", bounds=(0, 1), model=True)
    num_kv_shared_layers: int = key(0,
        "the last this many layers compute no keys and values: each reuses those of the last earlier layer "
        "of its kind (Gemma 4), in training and decoding (no cache of their own)", bounds=(0, None), model=True)
    use_double_wide_mlp: bool = key(False,
        "the key/value-sharing layers' MLPs are 2 × base_mlp_dim wide (Gemma 4 E2B)",
        model=True)
    per_layer_embed_dim: int = key(0,
        "per-layer embeddings (Gemma 4 E2B/E4B): a second table gives each layer a vector of this width per "
        "token, projected and added inside the layer; 0: none", bounds=(0, None), model=True)
    per_layer_vocab_size: int = key(0, "rows of the per-layer embedding table; 0: vocab_size", bounds=(0, None),
        model=True)
    final_logit_softcapping: float = key(0.0,
        "logits → c·tanh(logits / c) (Gemma 4: 30); 0: none", bounds=(0, None), model=True)
    normalization_layer_epsilon: float = key(1e-05, "epsilon of RMSNorm / LayerNorm", positive=True, model=True)
    attention_type: str = key("global",
        "the token mixer: global (grouped-query attention; sliding windows by the family's pattern or "
        "layer_types) | mla (multi-head latent attention, DeepSeek-V2/V3: the keys below; maxlite/models/mla.py)",
        choices=("global", "mla"), model=True)
    q_lora_rank: int = key(0, "mla: the queries' low-rank latent width (DeepSeek-V3 1536); 0: a full query "
        "projection (DeepSeek-V2-Lite)", bounds=(0, None), model=True)
    kv_lora_rank: int = key(512, "mla: the keys' and values' shared latent width (what decoding caches)",
        positive=True, model=True)
    qk_nope_head_dim: int = key(128, "mla: each query/key head's width without RoPE", positive=True, model=True)
    qk_rope_head_dim: int = key(64, "mla: each query head's RoPE width, and the one RoPE key all heads share "
        "(cached beside the latent)", positive=True, model=True)
    v_head_dim: int = key(128, "mla: each value head's width", positive=True, model=True)
    index_topk: int = key(2048,
        "DeepSeek sparse attention (decoder_block deepseek_v32, glm_moe_dsa; maxlite/models/dsa.py): the earlier tokens each "
        "query attends, chosen by the lightning indexer's scores (every token while there are no more)",
        positive=True, model=True)
    index_n_heads: int = key(64, "DeepSeek sparse attention: the indexer's heads", positive=True, model=True)
    index_head_dim: int = key(128, "DeepSeek sparse attention: the indexer's head width (its first "
        "qk_rope_head_dim dims rotated)", positive=True, model=True)
    index_stage: str = key("sparse",
        "DeepSeek sparse attention's training stage (DeepSeek-V3.2's recipe): sparse (each query attends its "
        "index_topk tokens; the indexer learns the heads' attention over them, everything trains) | "
        "dense_warmup (every query attends every earlier token; the indexer learns the heads' attention "
        "over all of them and is the only part that trains: start the sparse stage from its checkpoint with "
        "load_parameters_path)", choices=("sparse", "dense_warmup"))
    compress_rate_csa: int = key(4,
        "DeepSeek-V4's compressed sparse attention (maxlite/models/v4_attention.py): source tokens per compressed "
        "entry, in overlapping windows of twice this; the lightning indexer keeps each query's index_topk entries",
        positive=True, model=True)
    compress_rate_hca: int = key(128,
        "DeepSeek-V4's heavily compressed attention: source tokens per compressed entry (windows that do not "
        "overlap), every entry attended", positive=True, model=True)
    compress_rope_max_timescale: int = key(160000,
        "DeepSeek-V4: the RoPE base of the compressed layers (queries, keys and compressed entries; the "
        "rope_scaling_* keys scale it), where sliding-window layers use rope_max_timescale unscaled",
        positive=True, model=True)
    o_groups: int = key(0,
        "grouped output projection (DeepSeek-V4): the heads in this many groups, each projected to o_lora_rank, "
        "then mixed to the model width; 0: one projection", bounds=(0, None), model=True)
    o_lora_rank: int = key(1024, "grouped output projection: each group's width", positive=True, model=True)
    hc_mult: int = key(0,
        "manifold-constrained hyper-connections (DeepSeek-V4; maxlite/models/hyper.py): the residual is this "
        "many streams, collapsed into each branch's input and expanded from its output by weights computed "
        "per token, mixed by a doubly-stochastic matrix; 0: one plain residual", bounds=(0, None), model=True)
    hc_sinkhorn_iters: int = key(20, "hyper-connections: Sinkhorn-Knopp iterations of the mixing matrix",
        positive=True, model=True)
    hc_eps: float = key(1e-06, "hyper-connections: the floor of the weights and of the Sinkhorn sums",
        positive=True, model=True)
    num_hash_layers: int = key(0,
        "DeepSeek-V4's hash routing: the first this many MoE layers choose each token's experts by a fixed "
        "table of token id → experts (imported with the weights, never trained); the router only weights them",
        bounds=(0, None), model=True)
    mtp_num_layers: int = key(0,
        "multi-token prediction (DeepSeek-V3): extra layers, the k-th predicting token t+1+k from the previous "
        "depth's hidden state and token t+k's embedding, sharing embedding and output head; 0: none",
        bounds=(0, None), model=True)
    mtp_loss_scaling_factor: float = key(0.1,
        "multi-token prediction: weight of the mean of the extra layers' losses in the objective (reported as "
        "mtp_loss)", bounds=(0, None))
    logits_via_embedding: bool = key(False, "tie input embedding and output projection", model=True)
    use_qk_norm: bool = key(False,
        "RMSNorm over each head of q and k before RoPE in a family without q/k norms of its own (GLM-4.5's "
        "use_qk_norm); families with them (Qwen3, Gemma 3, OLMo 3) always have them", model=True)
    use_bias: bool = key(False,
        "the family's biases: q/k/v/o (llama2, qwen3, gemma3), q/k/v (qwen2: true), every linear and norm "
        "(gpt3: true)", model=True)
    attention_sink: bool = key(False,
        "a learned logit per query head joins every attention softmax's denominator and takes no value "
        "(gpt-oss's attention sinks)", model=True)
    init_scale: float = key(0.02, "stddev of normal initialisation", positive=True)
    dtype: str = key("bfloat16", "activation / compute dtype: float32 | bfloat16", choices=("float32", "bfloat16"))
    weight_dtype: str = key("float32", "parameter and optimizer-state dtype", choices=("float32", "bfloat16"))
    grad_dtype: str = key("float32",
        "the gradients' dtype from the backward pass to the optimizer (MaxText's grad_dtype): float32 gradients are "
        "cast to it before clipping and the update; a bfloat16 weight's gradient stays bfloat16",
        choices=("float32", "bfloat16"))
    scan_layers: bool = key(True, "stack layers and run them with scan (faster compiles for deep models)", model=True)
    remat_policy: str = key("full",
        "none | full | minimal | save_dots | save_qkv_proj | save_dot_except_mlp | save_attn_mlp_proj | "
        "offload_layer_inputs (what the backward pass keeps, offloads or recomputes)")

    num_experts: int = key(0,
        "routed experts per MoE layer (Mixtral 8, Qwen3-30B-A3B 128); must be > 0 for a MoE family, 0 "
        "otherwise", section="mixture of experts (decoder_block mixtral, qwen3_moe; docs/moe.md)", model=True)
    num_experts_per_tok: int = key(2, "experts each token is routed to (top-k)", model=True)
    base_moe_mlp_dim: int = key(0,
        "each routed expert's MLP width (Mixtral 8x7B 14336, Qwen3-30B-A3B 768); base_mlp_dim is the dense "
        "layers'", model=True)
    shared_experts: int = key(0,
        "experts every token also goes through, as one SwiGLU MLP of shared_experts × base_moe_mlp_dim "
        "(DeepSeek's); 0: none", model=True)
    shared_expert_gate: bool = key(False,
        "the shared experts' output scaled by sigmoid(x · w), w [base_emb_dim] learned (Qwen3-Next, Qwen3.5-MoE)",
        model=True)
    first_num_dense_layers: int = key(0,
        "the first this many layers keep a dense MLP (base_mlp_dim); the MoE layers follow", model=True)
    interleave_moe_layer_step: int = key(1,
        "after those, every this-th layer is MoE and the others dense (1: all MoE)", model=True)
    norm_topk_prob: bool = key(True,
        "divide each token's top-k router weights by their sum (Mixtral always; Qwen3-MoE's norm_topk_prob)",
        model=True)
    routed_score_func: str = key("softmax",
        "router scores: softmax over experts (Mixtral, Qwen3-MoE) | sigmoid (each expert alone; DeepSeek-V3) | "
        "sqrtsoftplus (√softplus, each expert alone; DeepSeek-V4)",
        choices=("softmax", "sigmoid", "sqrtsoftplus"), model=True)
    routed_bias: bool = key(False,
        "a per-expert bias added to the scores when choosing the top k only, not to the weights "
        "(DeepSeek-V3's, trained by no gradient: imported, zero, or moved by routed_bias_update_rate)", model=True)
    routed_bias_update_rate: float = key(0.0,
        "auxiliary-loss-free balancing (DeepSeek-V3: 0.001): after each optimizer step every MoE layer's "
        "routed_bias moves by this × sign(mean load - expert's load), from the step's expert load, outside "
        "the gradient; needs routed_bias; 0: the bias stays", bounds=(0, None))
    routed_scaling_factor: float = key(1.0,
        "the routed experts' weights multiplied by this after normalisation (DeepSeek-V3, GLM-4.5 2.5; GLM-4.5-Air 1.0)",
        positive=True, model=True)
    n_routing_groups: int = key(-1,
        "group-limited routing: the experts in this many equal groups, each token choosing only among the "
        "best topk_routing_group groups (a group's score: the sum of its top 2 choice scores with sigmoid, "
        "its best score with softmax; DeepSeek-V3 8); -1: no groups", model=True)
    topk_routing_group: int = key(-1, "the groups each token may route to (DeepSeek-V3 4); -1: no groups", model=True)
    routed_seq_aux_loss_weight: float = key(0.0,
        "weight of DeepSeek-V3's sequence-wise balance loss (E/k · Σ_e f_e · P_e per sequence, P from the "
        "scores normalised over experts; DeepSeek-V3 0.0001); reported as moe_seq_lb_loss", bounds=(0, None))
    router_logit_bias: bool = key(False,
        "a learned per-expert bias added to the router's logits, before the top k and the weights (gpt-oss)",
        model=True)
    mlp_bias: bool = key(False, "the routed experts' gate, up and down projections have biases (gpt-oss)", model=True)
    routed_weight_on_input: bool = key(False,
        "the router's weight multiplies the token going into its expert, not the expert's output (Llama 4); "
        "needs num_experts_per_tok=1", model=True)
    mlp_activations_limit: float = key(0.0,
        "gpt-oss's and DeepSeek-V4's clamped SwiGLU: the experts' gate clamped above and up on both sides at this "
        "limit (gpt-oss 7.0, DeepSeek-V4 10.0); 0: unclamped", bounds=(0, None), model=True)
    capacity_factor: float = key(-1.0,
        "-1: dropless; > 0: an expert takes at most ceil(this × T × k / E) of a sequence's tokens (first "
        "choices first, then in order), the rest are dropped (that expert adds 0)")
    ragged_buffer_factor: float = key(-1.0,
        "expert parallelism with a dropless implementation: each device's receive buffer holds this many times "
        "a balanced routing's rows (MaxText's key; e.g. 2), rows past it dropped and counted in moe_dropped; "
        "-1: every sender's rows (the worst case, expert-parallelism × a balanced routing's; nothing dropped)")
    load_balance_loss_weight: float = key(0.01,
        "weight of the auxiliary load-balancing loss added to the objective (Hugging Face's "
        "router_aux_loss_coef: Mixtral 0.02, Qwen3-MoE 0.001); reported as moe_lb_loss")
    router_z_loss_weight: float = key(0.0,
        "weight of the router z-loss (ST-MoE: mean squared log-sum-exp of the router logits); reported as "
        "moe_z_loss")
    moe_implementation: str = key("autoselected",
        "how the experts run: autoselected (capacity when capacity_factor > 0, else megablox on TPU, ragged "
        "on GPU, blocked on CPU) | dense (every expert on every token, masked: the reference) | ragged "
        "(tokens sorted by expert, jax.lax.ragged_dot) | blocked (sorted, each expert's rows padded to "
        "blocks, batched matmuls) | megablox (sorted, the Pallas grouped matmul; TPU, interpreted elsewhere) "
        "| capacity (fixed [E, capacity] buffers; needs capacity_factor > 0)")

    gdn_num_key_heads: int = key(16,
        "gated delta-net layers: query/key heads (each serves gdn_num_value_heads / this value heads)",
        section="gated delta-net layers (decoder_block qwen3_5, qwen3_5_moe, qwen3_next; docs/qwen.md) and "
        "Kimi delta attention layers (kimi_linear, as many key as value heads of one width; docs/families.md)",
        positive=True, model=True)
    gdn_num_value_heads: int = key(32, "gated delta-net layers: value heads (each its own state matrix)",
        positive=True, model=True)
    gdn_key_head_dim: int = key(128, "gated delta-net layers: query/key head width", positive=True, model=True)
    gdn_value_head_dim: int = key(128, "gated delta-net layers: value head width", positive=True, model=True)
    gdn_conv_kernel_dim: int = key(4, "gated delta-net layers: taps of the causal depthwise convolution",
        bounds=(2, None), model=True)
    gdn_chunk_size: int = key(64,
        "gated delta-net layers: tokens per chunk of the chunked parallel form (the state passes between "
        "chunks in float32); results do not depend on it beyond float32 rounding", positive=True)

    mamba_num_heads: int = key(128, "Mamba-2 layers: heads M (each its own state matrix [P, S])",
        section="Mamba-2 layers (decoder_block nemotron_h; maxlite/models/mamba2.py)", positive=True, model=True)
    mamba_head_dim: int = key(64, "Mamba-2 layers: head width P", positive=True, model=True)
    mamba_state_dim: int = key(128, "Mamba-2 layers: state width S (of B and C)", positive=True, model=True)
    mamba_num_groups: int = key(8, "Mamba-2 layers: groups of B and C (each read by mamba_num_heads / this "
        "heads) and of the gated norm", positive=True, model=True)
    mamba_conv_kernel_dim: int = key(4, "Mamba-2 layers: taps of the causal depthwise convolution",
        bounds=(2, None), model=True)
    mamba_conv_bias: bool = key(True, "Mamba-2 layers: the convolution has a bias", model=True)
    mamba_chunk_size: int = key(128,
        "Mamba-2 layers: tokens per chunk of the chunked scan (the state passes between chunks in float32); "
        "results do not depend on it beyond float32 rounding", positive=True)

    vision_encoder: str = key("",
        "the image encoder kind (maxlite/models/vision/): qwen_vit (Qwen3-VL / Qwen3.5: patches at the image's "
        "own resolution, 2-D RoPE, 2×2 merger, DeepStack) | siglip (Gemma 3: a fixed-size SigLIP tower and "
        "its pooled soft tokens) | gemma4_vit (Gemma 4: patches at the image's own aspect ratio, a 2-D learned "
        "position table, 2-D RoPE, position-pooled soft tokens); empty: a text-only model",
        choices=("", "qwen_vit", "siglip", "gemma4_vit"),
        section="vision encoder (Qwen3-VL, Gemma 3, Gemma 4; docs/vision.md)", model=True)
    vision_num_layers: int = key(0, "vision encoder: transformer layers", bounds=(0, None), model=True)
    vision_emb_dim: int = key(0, "vision encoder: width", bounds=(0, None), model=True)
    vision_mlp_dim: int = key(0, "vision encoder: MLP hidden width", bounds=(0, None), model=True)
    vision_num_heads: int = key(0, "vision encoder: attention heads", bounds=(0, None), model=True)
    vision_num_kv_heads: int = key(0, "gemma4_vit: key/value heads; 0: vision_num_heads", bounds=(0, None),
        model=True)
    vision_head_dim: int = key(0, "gemma4_vit: head width; 0: vision_emb_dim / vision_num_heads", bounds=(0, None),
        model=True)
    vision_pool_size: int = key(3, "gemma4_vit: patches averaged per side into one soft token (HF "
        "pooling_kernel_size)", positive=True, model=True)
    vision_rope_theta: float = key(100.0, "gemma4_vit: base of the 2-D RoPE over a patch's column and row",
        positive=True, model=True)
    vision_standardize: bool = key(False, "gemma4_vit: the soft tokens are standardised by a stored bias and scale "
        "(HF standardize)", model=True)
    vision_clipped: bool = key(False, "gemma4_vit: each linear's input and output are clamped to stored bounds "
        "(HF use_clipped_linears)", model=True)
    vision_bidirectional: bool = key(False, "gemma4_vit: the decoder's sliding-window layers see each image's "
        "tokens both ways (HF use_bidirectional_attention: vision); its global layers stay causal. siglip's "
        "layers always see them both ways", model=True)
    vision_patch_size: int = key(16, "vision encoder: pixels per patch side", positive=True, model=True)
    vision_temporal_patch_size: int = key(2, "qwen_vit: frames per patch (an image is repeated to fill them)",
        positive=True, model=True)
    vision_merge_size: int = key(2, "qwen_vit: patches merged per side into one decoder token", positive=True,
        model=True)
    vision_num_positions: int = key(0, "qwen_vit: learned position table (a square grid, interpolated to "
        "each image's grid); gemma4_vit: positions per axis of its 2-D table (HF position_embedding_size)",
        bounds=(0, None), model=True)
    vision_deepstack_layers: tuple[int, ...] = key((), "qwen_vit: encoder layers whose merged features are "
        "added to the first decoder layers' outputs at the image tokens (DeepStack; Qwen3-VL: [5, 11, 17])",
        model=True)
    vision_act: str = key("gelu_pytorch_tanh", "vision encoder: MLP activation (HF's names)",
        choices=("gelu_pytorch_tanh", "gelu"),
        model=True)
    vision_norm_epsilon: float = key(1e-6, "vision encoder: LayerNorm (gemma4_vit: RMSNorm) epsilon", positive=True,
        model=True)
    vision_image_size: int = key(0, "siglip: the square side every image is resized to", bounds=(0, None),
        model=True)
    vision_tokens_per_image: int = key(0, "siglip: soft tokens per image after pooling (Gemma 3: 256); "
        "gemma4_vit: at most this many per image (the processor's max_soft_tokens: 70, 140, 280, 560, 1120), "
        "fewer where the aspect ratio leaves part of the budget",
        bounds=(0, None), model=True)
    pad_token_id: int = key(-1, "the tokenizer's padding token; read by Gemma 4 with a vision tower, whose image "
        "tokens take this token's per-layer embedding (HF text_config.pad_token_id); -1: none", bounds=(-1, None),
        model=True)
    image_token_id: int = key(-1, "the placeholder token each image token takes the place of (Qwen "
        "<|image_pad|>, Gemma <image_soft_token>); -1: none", bounds=(-1, None), model=True)
    vision_train: str = key("frozen", "what of the vision encoder trains: frozen (none of it; the default) | "
        "projector (the layers that map its features to the decoder's width: qwen_vit's mergers, siglip's "
        "projector) | all. LoRA trains its adapters only, the encoder frozen", choices=("frozen", "projector", "all"))
    vision_start_token_id: int = key(-1, "the token before an image's placeholders (Qwen <|vision_start|>, "
        "Gemma <start_of_image>: the one a Gemma 3 prompt writes per image); -1: none", bounds=(-1, None), model=True)
    vision_end_token_id: int = key(-1, "the token after an image's placeholders (Qwen <|vision_end|>, Gemma "
        "<end_of_image>); -1: none", bounds=(-1, None), model=True)
    video_token_id: int = key(-1, "Qwen's video placeholder (<|video_pad|>; kept for export, videos are not "
        "read); -1: none", bounds=(-1, None), model=True)
    image_min_pixels: int = key(0, "qwen_vit: an image smaller than this is scaled up (the processor's "
        "min_pixels)", bounds=(0, None), model=True)
    image_max_pixels: int = key(0, "qwen_vit: an image larger than this is scaled down (the processor's "
        "max_pixels); 0: as it is", bounds=(0, None), model=True)
    image_mean: tuple[float, ...] = key((0.5, 0.5, 0.5), "per-channel mean the pixels are normalised by",
        model=True)
    image_std: tuple[float, ...] = key((0.5, 0.5, 0.5), "per-channel standard deviation the pixels are "
        "normalised by", model=True)
    mrope_sections: tuple[int, ...] = key((), "multimodal RoPE (Qwen3-VL): frequencies per time, height, width "
        "position, interleaved; summing to the rotated dims / 2. Empty: one position per token", model=True)

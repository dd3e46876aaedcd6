"""The recipe's schema: every key, its type, its default, the values it may take and the one line
of doc base.yml shows.

This is the one place a key is declared. `Keys` is the frozen, statically typed dataclass of them
all (`maxlite.recipe.Config`, what `maxlite.config.load` builds, adds what follows from them);
`configs/base.yml` is written from it (maxlite/base_yml.py: `python -m maxlite.base_yml`) and tests/test_schema.py fails
when the two differ. Adding a key: one `name: type = key(default, "doc", ...)` line in its section
below (with `choices=`, `bounds=` or `positive=` when its values are limited; `kind=` when it names
files), then `python -m maxlite.base_yml` to rewrite base.yml.

A leaf: no JAX and nothing of maxlite, so that loading (config.py),
the derived values (recipe.py) and the checks (config_checks.py) all import it and none imports
another back.
"""

# No `from __future__ import annotations` here: loading reads each field's type as a type (Field.type).
import dataclasses
import pathlib
from typing import Any

BASE_YML = pathlib.Path(__file__).parent / "configs" / "base.yml"
MESH_AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")  # order of the device mesh axes


def parallelism_key(prefix: str, axis: str) -> str:
    """The recipe key of a mesh axis's size: `{ici|dcn}_{axis}_parallelism`; the `stage` axis's keys
    keep MaxText's name, `{ici|dcn}_pipeline_parallelism`."""
    return f"{prefix}_{'pipeline' if axis == 'stage' else axis}_parallelism"
KINDS = ("path", "paths", "blend")  # values config.py resolves: a path, comma-separated paths, a data blend


class ConfigError(ValueError):
    """A user mistake in the recipe: printed as one line, exit code 2."""


def key(default: Any, doc: str, *, kind: str = "", section: str = "", choices: tuple = (),
        bounds: tuple[float | None, float | None] | None = None, positive: bool = False, model: bool = False) -> Any:
    """A key's default and its line in base.yml, and what its values may be (config_checks.validate
    refuses the rest in one line): one of `choices` (each item of a list), within inclusive `bounds`
    (low, high; None: unbounded), or `positive` (> 0). `kind` (KINDS) marks a value that names files;
    `section` opens a new section of base.yml, with this heading, at this key. `model`: the key is
    the model's (MODEL_KEYS)."""
    assert kind in ("", *KINDS), kind
    return dataclasses.field(default=default, metadata={
        "doc": doc, "kind": kind, "section": section, "choices": choices, "bounds": bounds, "positive": positive,
        "model": model})


@dataclasses.dataclass(frozen=True)
class Keys:
    """Every key of the recipe, typed; frozen. Lists are tuples."""

    run_name: str = key("",
        "run directory name under base_output_directory; empty → <recipe>_<model_name> (demo_tiny), plus the "
        "data source, objective and LoRA the command line changes (base_tiny_text): a re-run of the same command "
        "resumes it; another recipe's run in the directory is refused", section="run")
    base_output_directory: str = key("runs",
        "local path or gs://bucket/path; everything a run writes goes under {this}/{run_name}/", kind="path")
    steps: int = key(100, "number of optimizer steps to train", positive=True)
    seed: int = key(0, "seed for parameter init and synthetic data", bounds=(0, None))
    log_period: int = key(1, "print the per-step line every N steps", positive=True)
    enable_tensorboard: bool = key(True,
        "write TensorBoard event files (no TensorFlow needed); local run directories only (gs://: off, said in "
        "one line)")
    enable_progress_bar: bool = key(True, "show a progress bar when stdout is a terminal")
    check_memory_fit: bool = key(True, "refuse to start when the model + optimizer cannot fit in host memory")

    loggers: tuple[str, ...] = key((),
        "metric sinks beside metrics.jsonl and TensorBoard: [wandb], [mlflow] or [wandb, mlflow]; primary "
        "process only; a failing one warns once and training goes on", section="loggers",
        choices=("wandb", "mlflow"))
    wandb_project: str = key("",
        "W&B project; \"\" → WANDB_PROJECT, else W&B's default (a key set here overrides W&B's variable)")
    wandb_entity: str = key("", 'W&B entity (team or user); "" → WANDB_ENTITY, else your default entity')
    wandb_group: str = key("", 'W&B run group; "" → WANDB_RUN_GROUP, else none')
    wandb_mode: str = key("",
        'online | offline (local files; `wandb sync` later) | disabled; "" → WANDB_MODE, else online',
        choices=("", "online", "offline", "disabled"))
    wandb_dir: str = key("",
        'where W&B writes its local files; "" → WANDB_DIR, else {run_dir} (files under {run_dir}/wandb)', kind="path")
    mlflow_tracking_uri: str = key("",
        'MLflow tracking URI; "" → MLFLOW_TRACKING_URI, else a file store at {run_dir}/mlruns; local paths '
        "resolved; http(s)://, databricks, sqlite:/// as given")
    mlflow_experiment: str = key("",
        'MLflow experiment name (created when missing); "" → MLFLOW_EXPERIMENT_NAME (or '
        "MLFLOW_EXPERIMENT_ID), else MLflow's Default experiment")
    write_report: bool = key(True,
        "at the end of a run, write report.html + report.png (python -m maxlite.report) into the run "
        "directory")
    profiler: str = key("",
        '"" (off) | xplane: a jax.profiler trace of profiler_steps steps, on the primary process, under '
        "{run_dir}/profile (TensorBoard's profile plugin / xprof read it; docs/performance.md)",
        choices=("", "xplane"))
    skip_first_n_steps_for_profiler: int = key(1,
        "profiler: steps of each attempt before the trace starts (at least 1: the first step compiles)",
        bounds=(1, None))
    profiler_steps: int = key(5, "profiler: steps in the trace", bounds=(1, None))

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
        "router scores: softmax over experts (Mixtral, Qwen3-MoE) | sigmoid (each expert alone; DeepSeek-V3)",
        choices=("softmax", "sigmoid"), model=True)
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
        "gpt-oss's clamped SwiGLU: the experts' gate clamped above and up on both sides at this limit (7.0); "
        "0: unclamped", bounds=(0, None), model=True)
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
        "its pooled soft tokens); empty: a text-only model", choices=("", "qwen_vit", "siglip"),
        section="vision encoder (Qwen3-VL, Gemma 3; docs/vision.md)", model=True)
    vision_num_layers: int = key(0, "vision encoder: transformer layers", bounds=(0, None), model=True)
    vision_emb_dim: int = key(0, "vision encoder: width", bounds=(0, None), model=True)
    vision_mlp_dim: int = key(0, "vision encoder: MLP hidden width", bounds=(0, None), model=True)
    vision_num_heads: int = key(0, "vision encoder: attention heads", bounds=(0, None), model=True)
    vision_patch_size: int = key(16, "vision encoder: pixels per patch side", positive=True, model=True)
    vision_temporal_patch_size: int = key(2, "qwen_vit: frames per patch (an image is repeated to fill them)",
        positive=True, model=True)
    vision_merge_size: int = key(2, "qwen_vit: patches merged per side into one decoder token", positive=True,
        model=True)
    vision_num_positions: int = key(0, "qwen_vit: learned position table (a square grid, interpolated to "
        "each image's grid)", bounds=(0, None), model=True)
    vision_deepstack_layers: tuple[int, ...] = key((), "qwen_vit: encoder layers whose merged features are "
        "added to the first decoder layers' outputs at the image tokens (DeepStack; Qwen3-VL: [5, 11, 17])",
        model=True)
    vision_act: str = key("gelu_pytorch_tanh", "vision encoder: MLP activation (HF's names)",
        choices=("gelu_pytorch_tanh", "gelu"),
        model=True)
    vision_norm_epsilon: float = key(1e-6, "vision encoder: LayerNorm epsilon", positive=True, model=True)
    vision_image_size: int = key(0, "siglip: the square side every image is resized to", bounds=(0, None),
        model=True)
    vision_tokens_per_image: int = key(0, "siglip: soft tokens per image after pooling (Gemma 3: 256)",
        bounds=(0, None), model=True)
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

    attention: str = key("autoselected",
        "autoselected (flash on TPU, cudnn_flash on GPU, blockwise on CPU at T >= 2048, else dot_product) | "
        "dot_product | blockwise | flash | cudnn_flash", section="performance")
    attention_block_size: int = key(512,
        "blockwise: key block length (capped at max_target_length; must divide it)", positive=True)
    max_segments_per_seq: int = key(32,
        "cudnn_flash: packed documents per row passed to cuDNN as offsets (no dense mask); a batch with more "
        "falls back to the mask; 0 = always the mask")
    sa_block_q: int = key(512, "flash (splash): query block of the forward kernel", positive=True)
    sa_block_kv: int = key(512, "flash: key/value block of the forward kernel", positive=True)
    sa_block_kv_compute: int = key(512, "flash: key/value sub-block computed at once in the forward kernel",
        positive=True)
    sa_block_q_dkv: int = key(512, "flash: query block of the dK/dV kernel", positive=True)
    sa_block_kv_dkv: int = key(512, "flash: key/value block of the dK/dV kernel", positive=True)
    sa_block_kv_dkv_compute: int = key(512, "flash: key/value sub-block of the dK/dV kernel", positive=True)
    sa_block_q_dq: int = key(512, "flash: query block of the dQ kernel (unused with the fused backward)",
        positive=True)
    sa_block_kv_dq: int = key(512, "flash: key/value block of the dQ kernel (unused with the fused backward)",
        positive=True)
    sa_use_fused_bwd_kernel: bool = key(False, "flash: one backward kernel for dQ, dK, dV")
    num_vocab_tiling: int = key(-1,
        "loss over this many sequence chunks, never holding [B, T, V] logits, and its backward over (at most) as many "
        "vocabulary tiles, never holding the head's whole gradient on a device (1 = unchunked; -1 = auto: "
        "chunks of 512 tokens when T·V ≥ 2^27)")
    quantization: str = key("",
        "\"\" (none) | int8 | fp8 | fp8_full | fp8_gpu (GPUs only): the decoder layers' projections quantized "
        "in training, forward and backward, through Qwix (docs/performance.md); master weights, optimizer "
        "state, checkpoints and exports unchanged")
    cpu_matmul: str = key("auto",
        "CPU only: how bf16 matmuls run: auto (time both at the model's shapes once per CPU model, keep the "
        "faster; cached in cpu_matmul.json beside jax_cache_dir) | bf16 (native bf16 × bf16 → f32 dots: CPUs "
        "with bf16 instructions) | f32 (operands upcast to float32: AVX2-only CPUs)",
        choices=("auto", "bf16", "f32"))
    jax_cache_dir: str = key("~/.cache/maxlite/jax",
        'JAX persistent compilation cache (a re-run skips compiling); "" disables', kind="path")

    per_device_batch_size: float = key(2.0, "sequences per device per micro-batch", section="batch and sequence",
        positive=True)
    max_target_length: int = key(256, "sequence length T", positive=True)
    gradient_accumulation_steps: int = key(1, "micro-batches summed per optimizer step", positive=True)

    learning_rate: float = key(0.0003, "peak learning rate", section="optimizer", bounds=(0, None))
    lr_schedule_type: str = key("cosine",
        "cosine | linear | constant | wsd (after warmup; wsd: stable at the peak, then a decay over the "
        "schedule's last wsd_decay_steps_fraction)", choices=("cosine", "linear", "constant", "wsd"))
    wsd_decay_steps_fraction: float = key(0.1,
        "wsd: fraction of the schedule's steps spent decaying to the final rate, at its end", bounds=(0, 1))
    wsd_decay_style: str = key("linear", "wsd: the decay's shape: linear | cosine | 1-sqrt",
        choices=("linear", "cosine", "1-sqrt"))
    warmup_steps_fraction: float = key(0.1, "fraction of the schedule spent in linear warmup from 0", bounds=(0, 1))
    lr_warmup_steps: int = key(-1,
        "the warmup's length in steps (-1: warmup_steps_fraction × the schedule); fix it to branch a wsd decay "
        "with a new `steps` without moving the warmup", bounds=(-1, None))
    learning_rate_schedule_steps: int = key(-1,
        "the schedule's length (MaxText's key); -1: `steps`. Set it and a higher `steps` on resume extends "
        "the run at the final rate without changing its past schedule", bounds=(-1, None))
    learning_rate_final_fraction: float = key(0.1, "final learning rate as a fraction of the peak (cosine, linear)",
        bounds=(0, 1))
    adam_b1: float = key(0.9, "AdamW beta1", bounds=(0, 1))
    adam_b2: float = key(0.95, "AdamW beta2", bounds=(0, 1))
    adam_eps: float = key(1e-08, "AdamW epsilon", positive=True)
    adam_weight_decay: float = key(0.1, "AdamW decoupled weight decay", bounds=(0, None))
    mu_dtype: str = key("",
        "dtype of the optimizer's first moment (Adam's mu, Muon's momentum; MaxText's mu_dtype); \"\": weight_dtype. "
        "The second moment stays in weight_dtype. A checkpoint resumes across a change (its moments are cast)",
        choices=("", "float32", "bfloat16"))
    opt_type: str = key("adamw",
        "adamw | muon: optax's Muon on the decoder layers' weight matrices (each layer's, each expert's), AdamW "
        "(adam_*) on embeddings, the output head, norms and biases (docs/optimizers.md)", choices=("adamw", "muon"))
    muon_beta: float = key(0.95, "muon: momentum decay of the matrices' gradient average (Nesterov)", bounds=(0, 1))
    muon_weight_decay: float = key(0.0,
        "muon: decoupled weight decay of the Muon matrices (multiplied by the learning rate)", bounds=(0, None))
    muon_consistent_rms: float = key(0.0,
        "muon: 0 scales each update by its matrix's shape (sqrt(max(1, fan_out/fan_in))); > 0 gives every matrix "
        "update this RMS (0.2 matches AdamW's, so Muon shares AdamW's learning rate)", bounds=(0, None))
    reset_optimizer_state: bool = key(False,
        "resume a checkpoint's weights and step with a fresh optimizer state (required to change opt_type on "
        "resume)")
    gradient_clipping_threshold: float = key(1.0, "clip by global norm; 0 disables", bounds=(0, None))
    z_loss_weight: float = key(0.0, "weight of the z-loss (log-partition squared); 0 disables", bounds=(0, None))

    ici_data_parallelism: int = key(1,
        "pure data parallelism inside a slice",
        section="mesh (ICI within a slice/host, DCN across slices/hosts); one value may be -1 and is filled")
    ici_pipeline_parallelism: int = key(1,
        "pipeline stages inside a slice: consecutive layers per stage, micro-batches flowing through them "
        "(docs/parallelism.md)")
    ici_fsdp_parallelism: int = key(-1, "fully sharded data parallelism inside a slice")
    ici_context_parallelism: int = key(1,
        "context parallelism inside a slice: each sequence split over this many devices (long context; "
        "docs/long-context.md)")
    ici_expert_parallelism: int = key(1,
        "expert parallelism inside a slice: experts split over it, tokens sent to them (all-to-all); the "
        "batch is split over it too (data parallelism for the other weights)")
    ici_tensor_parallelism: int = key(1, "tensor (model) parallelism inside a slice")
    dcn_data_parallelism: int = key(-1, "data parallelism across slices")
    dcn_pipeline_parallelism: int = key(1, "pipeline stages across slices (only activations cross between stages)")
    dcn_fsdp_parallelism: int = key(1, "fsdp across slices")
    dcn_context_parallelism: int = key(1,
        "context parallelism across slices (rarely useful: attention gathers keys over this axis every layer)")
    dcn_expert_parallelism: int = key(1, "expert parallelism across slices")
    dcn_tensor_parallelism: int = key(1, "tensor parallelism across slices (rarely useful)")
    num_layers_per_pipeline_stage: int = key(-1,
        "pipeline: consecutive layers a stage runs at once; -1: layers / (stages × num_pipeline_repeats)",
        bounds=(-1, None))
    num_pipeline_repeats: int = key(-1,
        "pipeline: times the micro-batches go round the stages (> 1: the circular schedule, each stage holding "
        "that many non-adjacent groups of layers: a smaller bubble); -1: layers / (stages × "
        "num_layers_per_pipeline_stage), or 1 when that is -1 too", bounds=(-1, None))
    num_pipeline_microbatches: int = key(-1,
        "pipeline: micro-batches each (accumulation) batch is cut into, at least the stages; -1: the stages",
        bounds=(-1, None))
    set_remat_policy_on_pipeline_iterations: bool = key(True,
        "pipeline: remat_policy applied to each iteration of the schedule as well as to each layer, so that "
        "an iteration keeps only its stage's input for the backward pass (which recomputes the stage's "
        "layers: one more forward); false: each iteration keeps its layers' inputs")
    num_slices: int = key(-1, "number of slices (TPU multislice); -1 reads it from the devices")
    context_parallel_load_balance: bool = key(True,
        "with context parallelism: shard i holds sequence chunks i and 2n−1−i (n shards), so causal attention "
        "costs every shard the same; invisible outside the step")

    dataset_type: str = key("synthetic",
        "synthetic | text | indexed | sft (chat records; docs/sft.md) | preference (DPO pairs) | prompts (GRPO; "
        "docs/alignment.md)", section="data",
        choices=("synthetic", "text", "indexed", "sft", "preference", "prompts"))
    dataset_path: str = key("",
        'text, sft: files, directories or globs, comma-separated (jsonl, json, .gz, .zst, parquet, arrow); "" '
        "→ bundled KJV corpus (sft: the bundled chat set)", kind="paths")
    eval_dataset_path: str = key("",
        'text, sft: eval files like dataset_path; "" → the bundled eval split (only when dataset_path is "")',
        kind="paths")
    json_keys: str = key("text",
        "record fields holding the text (comma-separated); each key's text is one document")
    tokenizer_path: str = key("",
        'tokenizer.json, sentencepiece .model, or a dir with tokenizer.json or vocab.json+merges.txt; "" → '
        "bundled (4096 ids)", kind="path")
    bos_id: int = key(-1, "beginning-of-document id; -1 → from the tokenizer")
    eos_id: int = key(-1, "end-of-document id; -1 → from the tokenizer")
    add_bos: bool = key(False, "text: prepend bos_id to every document")
    add_eos: bool = key(True, "text: append eos_id to every document")
    data_prefix: tuple[float | str, ...] = key((),
        "indexed: prefix, or [w1,prefix1,w2,prefix2,...] blend (Megatron .bin/.idx without extension; gs:// "
        "staged)", kind="blend")
    eval_data_prefix: tuple[float | str, ...] = key((),
        "indexed: separate eval blend like data_prefix; [] → the validation part of data_split", kind="blend")
    data_split: str = key("99,1,0", "indexed: train,valid,test share of each prefix's documents (Megatron style)")
    data_shuffle_seed: int = key(0, "seed of the data order (documents, samples, packing)")
    data_shuffle: bool = key(True, "shuffle training data (eval data is never shuffled)")
    data_bad_record_policy: str = key("skip",
        "malformed records: skip (count, report the first few as file:line) | error", choices=("skip", "error"))
    data_shuffle_window: int = key(1024, "text: documents in the streaming shuffle window", bounds=(1, None))
    max_image_patches: int = key(4096, "vision SFT (qwen_vit): image patches a packed row holds (its documents' "
        "images together; a multiple of vision_merge_size²); a conversation with more is reported and skipped",
        positive=True)
    max_images_per_row: int = key(4, "vision SFT (siglip): images a packed row holds (its documents' together, "
        "each vision_image_size square); a conversation with more is reported and skipped", positive=True)
    packing_bins: int = key(16, "text: rows packed at once (first-fit); more bins → less padding", bounds=(1, None))
    grain_worker_count: int = key(0, "indexed: grain worker processes (0 = in-process; small machines want 0)",
        bounds=(0, None))
    grain_threads: int = key(2, "grain reader threads per process", bounds=(0, None))
    grain_prefetch: int = key(4, "batches prefetched ahead of the step", bounds=(0, None))
    data_cache_dir: str = key("", 'local cache for gs:// data; "" → ~/.cache/maxlite/data', kind="path")
    sft_template: str = key("auto",
        "sft: chat template: auto (the tokenizer's own chat_template, else chatml) | llama3 | chatml",
        choices=("auto", "llama3", "chatml"))
    sft_train_on_inputs: bool = key(False,
        "sft: the loss also covers system/user turns and template text (default: assistant answers only)")
    sft_allow_degenerate_mask: bool = key(False,
        "sft: train even when the audit finds 0% or 100% of target tokens supervised, or every assistant "
        "answer empty")
    sft_audit_records: int = key(512, "sft: records the mask audit reads (the first ones of the train files)",
        bounds=(1, None))
    sft_audit_examples: int = key(3, "sft: rendered examples, supervised spans marked, in the run's sft_audit.txt",
        bounds=(0, None))

    enable_checkpointing: bool = key(True,
        "save checkpoints and resume from the latest complete one when the run restarts",
        section="checkpoints and eval")
    checkpoint_dir: str = key("",
        'local path or gs://bucket/path; "" → {base_output_directory}/{run_name}/checkpoints', kind="path")
    checkpoint_period: int = key(50, "save every N steps (0 → only on completion)", bounds=(0, None))
    async_checkpointing: bool = key(True, "write in the background; the loop only waits for the device→host copy")
    max_num_checkpoints_to_keep: int = key(3, "keep the latest N checkpoints (0 → keep all)", bounds=(0, None))
    checkpoint_keep_best_k: int = key(0,
        "also keep the k checkpoints with the lowest eval loss (NeMo save_top_k); 0 disables", bounds=(0, None))
    save_checkpoint_on_completion: bool = key(True, "save at the last step")
    checkpoint_error_policy: str = key("stop",
        "a failed save (storage down): stop (end the run at once, status failed, exit 74; the launcher "
        "restarts from the last complete checkpoint) | continue (keep training; the run still ends failed, "
        "exit 74, unless a later save succeeds)", choices=("continue", "stop"))
    load_parameters_path: str = key("",
        "start from these weights only (fresh optimizer, step 0): a checkpoint dir or one step dir", kind="path")
    load_full_state_path: str = key("",
        "start from this full state (params, optimizer, step, data position); ignored when checkpoint_dir has "
        "one", kind="path")
    eval_interval: int = key(0,
        "evaluate every N steps (0 disables); eval loss + perplexity go to every metric output", bounds=(0, None))
    eval_steps: int = key(10, "eval batches per evaluation (the same batches every time)", bounds=(0, None))

    ray_num_workers: int = key(-1,
        "Ray Train workers = hosts (TPU VM / GPU node; CPU: processes); -1 → TPU: from tpu_topology, chips "
        "per host, num_slices; else 2", section="launch: ray")
    ray_use_tpu: bool = key(False, "one worker per TPU host (ScalingConfig use_tpu)")
    tpu_topology: str = key("", "TPU slice topology, e.g. 4x4 for v6e-16 (ScalingConfig topology)")
    tpu_accelerator_type: str = key("", "e.g. TPU-V6E (ScalingConfig accelerator_type)")
    tpu_chips_per_host: int = key(4, "chips (JAX devices) per TPU host")
    ray_use_gpu: bool = key(False, "one worker per GPU node")
    ray_gpus_per_worker: int = key(8, "GPUs per worker when ray_use_gpu")
    ray_cpus_per_worker: int = key(1, "CPUs reserved per worker (CPU runs)")
    ray_simulated_devices_per_worker: int = key(2, "CPU runs: XLA host devices per worker process")
    ray_cpu_affinity: bool = key(False,
        "CPU runs: pin each training worker and rollout worker to as many of its machine's cores as it reserved "
        "(ray_cpus_per_worker, rollout_worker_cpus), cores no other pinned process holds")
    ray_min_workers: int = key(0,
        "elastic (1 ≤ this < workers): a group that lost a host restarts on the hosts left (at least this "
        "many), the same global batch through more gradient accumulation; 0: fixed size", bounds=(0, None))
    elastic_wait_seconds: int = key(60,
        "elastic: how long a restart waits for the full group before it starts on fewer hosts", bounds=(1, None))

    preemption_signals: str = key("SIGTERM,SIGUSR1",
        'comma-separated signals that mean "save at the next safe point, exit 0, requeue me"', section="resilience")
    preemption_grace_seconds: int = key(120, "after a preemption signal, give up saving and exit after this long",
        bounds=(0, None))
    max_time: str = key("", 'D:HH:MM:SS wall-clock budget; save and exit cleanly before it runs out ("" → none)')
    resilience_sync_period: int = key(1, "steps between the cross-host votes (stop flags, straggler medians)",
        bounds=(1, None))
    watchdog: bool = key(True, "hang watchdog: stacks of all threads to the log, exit code 75 on a hang")
    watchdog_initial_timeout: int = key(1800,
        "seconds allowed to setup and to the first (compiling) step/eval/checkpoint", bounds=(0, None))
    watchdog_factor: float = key(5.0, "later timeouts = this × the longest interval seen for that section",
        bounds=(1, None))
    watchdog_min_timeout: int = key(60, "never time a section out sooner than this (seconds)", bounds=(0, None))
    run_lease_seconds: int = key(120,
        "one writer per run directory: the primary holds {run_dir}/lease.json, renewed every this/4 s; a "
        "second launch is refused, a lease this stale (or of a dead process on this host, or of an earlier "
        "attempt of the same Slurm/Ray job) is taken over; 0 = no lease", bounds=(0, None))
    max_restarts: int = key(3,
        "THE restart budget of the run: restarts after a failure (crash, hang, straggler, failed save) before "
        "it fails, counted in {run_dir}/restarts.json across requeues and launchers (Ray, Slurm); -1 = "
        "unlimited; preemptions are not counted", bounds=(-1, None))
    straggler_report_interval: float = key(300.0,
        "seconds between straggler reports (per-process step-time medians gathered)")
    straggler_threshold: float = key(0.7,
        "a process whose relative or individual score is below this is a straggler", bounds=(0, 1))
    stop_if_straggler: bool = key(False,
        "stop the job (exit 76) when a straggler is reported, so the launcher replaces it")
    inmemory_snapshot_period: int = key(0, "steps between in-memory (checkpointless) snapshots; 0 disables",
        bounds=(0, None))
    inmemory_snapshot_max_bytes: int = key(0,
        "memory the snapshots (own + peer replica) may use per host; 0 → 1/4 of host RAM", bounds=(0, None))
    inmemory_snapshot_keeper: str = key("auto",
        "where snapshots live outside the training processes: auto | shm | ray", choices=("auto", "shm", "ray"))
    spike_max_rollbacks: int = key(3,
        "a non-finite (or spiked) loss rolls back to the newest snapshot/checkpoint before it and skips the "
        "data since; stop after this many (0: stop at once)", bounds=(0, None))
    spike_factor: float = key(0.0,
        "also roll back when the loss stays above this × the median of the last 32 good losses (0: non-finite "
        "only; 2–4 is usual)", bounds=(0, None))
    spike_patience: int = key(3, "... for this many steps in a row", bounds=(1, None))
    train_objective: str = key("lm",
        "lm (next-token loss: pre-training, SFT) | dpo (dataset_type=preference) | grpo "
        "(dataset_type=prompts)", section="alignment: DPO and GRPO after SFT (docs/alignment.md)",
        choices=("lm", "dpo", "grpo"))
    alignment_sft_steps: int = key(0,
        "dpo/grpo: first train this many steps with the lm loss on the data's reference answers (chosen / "
        "answer); their end is the reference policy", bounds=(0, None))
    alignment_sft_learning_rate: float = key(0.0,
        "dpo/grpo: the warm-up's constant learning rate (0: the run's schedule); the objective's schedule "
        "then spans the steps left", bounds=(0, None))
    dpo_beta: float = key(0.1, "dpo: β, how far the policy may move from the reference", bounds=(0, None))
    dpo_label_smoothing: float = key(0.0,
        "dpo: ε of conservative DPO (the share of pairs assumed mislabelled), in [0, 0.5)", bounds=(0, 0.499))
    dpo_precompute_reference: bool = key(False,
        "dpo: the reference's log-probs computed once before step 0 (saved in the run dir) instead of keeping "
        "a reference copy of the weights; needs alignment_sft_steps=0")
    grpo_num_generations: int = key(8, "grpo: completions sampled per prompt (G); rows per step = prompts × G",
        positive=True)
    grpo_max_new_tokens: int = key(16,
        "grpo: tokens sampled per completion; prompts get max_target_length minus this", positive=True)
    grpo_temperature: float = key(1.0, "grpo: sampling temperature (> 0)", positive=True)
    # not sample_top_k: that is the sample_prompts hook's display sampling (greedy by default), this the
    # behaviour policy the loss corrects for; both cut with decode.sample
    grpo_top_k: int = key(0,
        "grpo: rollouts sample among the k most likely tokens (MaxText decode_sampling_top_k, vLLM/NeMo-RL "
        "top_k); 0: no cut; the sampler's log-probs are the cut, renormalised distribution's", bounds=(0, None))
    grpo_top_p: float = key(1.0,
        "grpo: ... then among the fewest top tokens holding this probability (MaxText decode_sampling_nucleus_p, "
        "vLLM/NeMo-RL top_p); 1: no cut", positive=True, bounds=(0.0, 1.0))
    grpo_beta: float = key(-1.0,
        "grpo: weight β of the k3 KL penalty to the reference (MaxText/TRL beta, verl kl_loss_coef); -1: the "
        "loss_algo's own (0.04; dapo 0); 0: no penalty, and no reference copy of the weights is kept",
        bounds=(-1, None))
    grpo_epsilon: float = key(0.2,
        "grpo: ε_low of the ratio clipping clip(ρ, 1 − ε_low, 1 + ε_high) (MaxText epsilon, verl clip_ratio_low)",
        bounds=(0, None))
    grpo_iterations: int = key(1,
        "grpo: updates per batch of completions (μ); > 1 uses the sampling policy's log-probs for ρ", positive=True)
    # RL losses (objectives/rl_loss.py, docs/alignment.md)
    loss_algo: str = key("grpo",
        "grpo: the policy loss (MaxText/Tunix loss_algo): grpo (per-token ratio, (r − mean)/std advantage) | "
        "gspo-token (GSPO's sequence ratio, per token) | dapo (clip-higher, no KL) | dr_grpo (r − mean, "
        "constant normaliser)", choices=("grpo", "gspo-token", "dapo", "dr_grpo"))
    loss_agg_mode: str = key("",
        "grpo: how token losses add up (verl/MaxText loss_agg_mode): token-mean | sequence-mean-token-mean | "
        "sequence-sum (÷ grpo_max_new_tokens × rows, Dr. GRPO's); \"\": the loss_algo's own (grpo, dapo: "
        "token-mean; gspo-token: sequence-mean-token-mean; dr_grpo: sequence-sum)",
        choices=("", "token-mean", "sequence-mean-token-mean", "sequence-sum"))
    epsilon_high: float = key(-1.0,
        "grpo: ε_high of the ratio clipping (MaxText/Tunix epsilon_high, verl clip_ratio_high); -1: the "
        "loss_algo's own (grpo_epsilon: symmetric; dapo 0.28, clip-higher)", bounds=(-1, None))
    dynamic_sampling: bool = key(False,
        "grpo: groups whose rewards are all equal get no loss weight, their share logged as groups_dropped "
        "(DAPO's dynamic sampling; verl algorithm.filter_groups.enable, NeMo-RL grpo.use_dynamic_sampling); the refill: "
        "dynamic_sampling_max_batches")
    dynamic_sampling_max_batches: int = key(1,
        "grpo with dynamic_sampling: the most prompt batches a step samples to fill its batch with groups whose "
        "rewards differ (DAPO's refill; verl algorithm.filter_groups.max_num_gen_batches, NeMo-RL "
        "grpo.dynamic_sampling_max_gen_batches): further batches are read from the run's data (its saved position "
        "counts them), the groups past the batch's number dropped; still short after this many, the step trains "
        "on the groups it found and the rest of its batch carries no weight (logged: generation_batches, "
        "groups_kept; verl and NeMo-RL raise instead, and verl's 0 = unlimited has no equal here); 1: no refill",
        positive=True)
    overlong_filtering: bool = key(False,
        "grpo: completions that reach grpo_max_new_tokens without ending get no loss weight (NeMo-RL "
        "overlong_filtering, DAPO's overlong filtering)")
    tis_cap: float = key(2.0,
        "grpo: with the sampler's log-probs in the batch (sampler_logps), each token's policy loss × "
        "min(π_old/π_sampler, this): truncated importance sampling (verl tis_imp_ratio_cap)", positive=True)
    # RL rollout engine
    rollout_engine: str = key("maxlite",
        "grpo: what samples the completions: maxlite (continuous batching over decode slots, "
        "maxlite/rollout/) | vllm (needs the vllm package; MaxText's RL samples with vLLM)",
        choices=("maxlite", "vllm"))
    max_num_seqs: int = key(64, "grpo: decode slots of the rollout engine, sequences decoded at once "
                            "(MaxText's / vLLM's max_num_seqs)", positive=True)
    max_num_batched_tokens: int = key(2048, "grpo: prompt tokens the rollout engine prefills at once "
                                      "(MaxText's / vLLM's max_num_batched_tokens)", positive=True)
    rollout_paged_kv: bool = key(False,
        "grpo: the rollout engine keeps attention's K/V and MLA's latents in a pool of blocks read through "
        "per-sequence block tables (vLLM's PagedAttention; a prompt's full blocks shared by its completions); "
        "false: a [prompt + max_new_tokens] row per slot")
    rollout_block_size: int = key(16, "grpo, rollout_paged_kv: positions per cache block (vLLM's block_size)",
                                  positive=True)
    rollout_num_blocks: int = key(0,
        "grpo, rollout_paged_kv: cache blocks in the pool (vLLM's num_gpu_blocks_override); "
        "0: max_num_seqs x the longest sequence's blocks", bounds=(0, None))
    reward_functions: tuple[str, ...] = key((),
        'grpo: "package.module:function" each; e.g. maxlite.objectives.rewards:exact_answer')
    reward_weights: tuple[float, ...] = key((), "grpo: one weight per reward function ([] = 1 each)")
    # RL tools: multi-turn rollouts (maxlite/rollout/tools.py, docs/rl.md)
    rollout_tools: tuple[str, ...] = key((),
        'grpo: tools a completion may call, "package.module:function" each, called by the function\'s name '
        "(MaxText/Tunix agentic rollouts, NeMo-RL multi-turn environments): a completion that ends on "
        "tool_call_end has its call run in a worker process and the answer appended as a turn (not trained on), "
        "then generation continues; [] = none")
    max_tool_turns: int = key(4,
        "grpo with rollout_tools: the most tool calls a completion makes; a call past them ends the completion "
        "unanswered (not ended: overlong_filtering drops it) (NeMo-RL grpo.max_rollout_turns counts the model's "
        "turns: this + 1)", positive=True)
    tool_call_start: str = key("<tool_call>",
        "grpo with rollout_tools: the text before a call; the call is the text after the last one in the turn "
        "and what came just before it (the prompt, or the last tool answer): {\"name\": ..., \"arguments\": "
        "{...}} or `name argument text`")
    tool_call_end: str = key("</tool_call>",
        "grpo with rollout_tools: the text that ends a call and the model's turn; one token of the tokenizer "
        "(the rollout engine stops on it)")
    tool_response_format: str = key("<tool_response>{answer}</tool_response>",
        "grpo with rollout_tools: the turn appended after a call, {answer} replaced by the tool's answer (or "
        "its error); write the chat template's turn markers here too (docs/rl.md)")
    tool_timeout_seconds: float = key(5.0,
        "grpo with rollout_tools: time limit of one tool call, in a worker process: past it the worker is "
        "killed and the model is answered an error (counted in tool_timeouts)", positive=True)
    tool_workers: int = key(2, "grpo with rollout_tools: worker processes the tools run in (per training process)",
        positive=True)
    # RL placement: where the rollouts run (maxlite/rollout/reshard.py; MaxText's RL hardware keys)
    trainer_devices_fraction: float = key(1.0,
        "grpo: the first this share of the devices train (MaxText's name); 1 with sampler_devices_fraction 1: "
        "trainer and rollouts share every device, alternating (colocated)", bounds=(0.0, 1.0))
    sampler_devices_fraction: float = key(1.0,
        "grpo: the last this share of the devices generate (MaxText's name); below 1, trainer and sampler "
        "shares must not overlap (separate placement: weights resharded onto them each step)", bounds=(0.0, 1.0))
    rollout_data_parallelism: int = key(-1,
        "grpo: model replicas on the sampler's devices (MaxText's name; -1: the devices left by "
        "rollout_tensor_parallelism)", bounds=(-1, None))
    rollout_tensor_parallelism: int = key(1,
        "grpo: tensor shards of each replica on the sampler's devices (MaxText's name)", positive=True)
    off_policy_steps: int = key(0,
        "grpo: sample the prompts of the next this many steps while a step trains (MaxText's name; NeMo-RL's "
        "max_trajectory_age_steps); needs separate placement; 0: synchronous", bounds=(0, None))
    rollout_workers: int = key(0,
        "grpo: rollout workers as Ray actors of their own, each generating a share of the prompts on its own "
        "devices (NeMo-RL's separate generation cluster, policy.generation.colocated.enabled=false); weights "
        "pushed through Ray's object store each step, a dead worker replaced; 0: in-process", bounds=(0, None))
    rollout_worker_cpus: float = key(1.0,
        "grpo: CPUs Ray reserves for each rollout worker (NeMo-RL: generation resources.num_nodes × "
        "gpus_per_node, here per actor)", bounds=(0.0, None))
    rollout_worker_gpus: float = key(0.0,
        "grpo: GPUs Ray reserves for each rollout worker (NeMo-RL's generation resources.gpus_per_node; "
        "0 on CPU)", bounds=(0.0, None))
    rollout_worker_timeout_s: float = key(600.0,
        "grpo: a rollout worker's share not answered within this many seconds (its start, weights and first "
        "compile included) is a hang: the worker is killed and replaced, the share re-run (counted in "
        "rollout_worker_restarts and rollout_worker_hangs); 600: minutes above a share's time for a model that "
        "fits a host, and below watchdog_initial_timeout, so one worker is replaced before the watchdog "
        "restarts the run; raise it for long completions on big models; 0: wait forever", bounds=(0.0, None))
    # RL rewards
    reward_timeout_seconds: float = key(5.0,
        "grpo: time limit of one reward call (a batch, or one completion of a per-completion function such as "
        "math_verify), run in a worker process: past it the worker is killed and those completions score 0, "
        "counted in reward_timeouts (a raise or a dead worker: reward_failures)", positive=True)
    reward_workers: int = key(2, "grpo: worker processes the reward functions run in (per training process)",
        positive=True)
    bundled_prompts: str = key("arith",
        'prompts: the bundled set read when dataset_path is "": arith ("What is 2 + 3?") | word_problems '
        "(grade-school word problems, integer answers; data/bundled/build_word_problems.py)",
        choices=("arith", "word_problems"))
    eval_pass_k: int = key(0,
        "grpo: eval also reports pass_at_{k}, from grpo_num_generations samples per prompt at grpo_temperature "
        "(the unbiased estimator of Chen et al. 2021); 0: only the greedy pass_at_1", bounds=(0, None))
    eval_pass_threshold: float = key(1.0,
        "grpo: an eval completion passes when its summed reward is at least this")

    lora_rank: int = key(0,
        "adapter rank r; 0 = off (full fine-tuning)",
        section="LoRA: low-rank adapters, base weights frozen (docs/lora.md)", bounds=(0, None))
    lora_alpha: float = key(16.0, "the update is (lora_alpha / lora_rank) · x A B")
    lora_dropout: float = key(0.0, "dropout on the adapters' input while training (PEFT's), in [0, 1)")
    lora_targets: tuple[str, ...] = key(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "HF / PEFT module names (latent attention's and the delta-net's own: docs/lora.md)",
        choices=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                 "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj"))

    sample_prompts: tuple[str, ...] = key((),
        "prompts to continue at the end of a finished run (and every sample_every_steps); [] = none; sft: "
        "user turns in the chat template",
        section="sampling: continuations from the model being trained (KV-cache decode; python -m maxlite.generate)")
    sample_every_steps: int = key(0, "also sample every N steps (0: only at the end)", bounds=(0, None))
    sample_max_new_tokens: int = key(32, "new tokens per prompt", bounds=(1, None))
    sample_temperature: float = key(0.0, "0: greedy; else softmax(logits / temperature)", bounds=(0, None))
    sample_top_k: int = key(0, "sample among the k most likely tokens (0: all)", bounds=(0, None))

    fault_type: str = key("",
        "fault injection for tests/demos: crash | hang | slow | starve | sigterm | crash_in_snapshot | "
        "crash_in_checkpoint | nan (the rows that step trains on give a non-finite loss: the data's, or GRPO's "
        "sampled ones) | pause", section="fault injection, for tests and demos (docs/resilience.md); fires once per run directory",
        choices=("", "crash", "hang", "slow", "starve", "sigterm", "crash_in_snapshot", "crash_in_checkpoint", "nan",
                 "pause"))
    fault_step: int = key(-1, "step at which the fault fires (once per run directory)")
    fault_process: int = key(0, "process index the fault fires on")
    fault_slowdown_factor: float = key(3.0,
        "slow: that process's step work takes this many times longer from fault_step on", bounds=(1, None))
    fault_pause_seconds: float = key(10.0,
        "pause: that process sleeps this long once, after dispatching step fault_step", bounds=(0, None))


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(Keys)}


# The model's keys: those a checkpoint's parameters, and the function they compute, depend on (the
# parameter tree and its shapes, the layer kinds, norms, RoPE, routing, softcapping), not how a run
# trains or runs it (dtypes, loss weights, implementations). What recipe.yml of an import holds, what
# a run directory's identity compares (run_identity.py) and what a checkpoint that does not fit is
# told apart by (checkpoints/restore.py).
MODEL_KEYS: tuple[str, ...] = tuple(name for name, f in FIELDS.items() if f.metadata["model"])


def keys_of(kind: str) -> tuple[str, ...]:
    """The keys whose values are of `kind` (KINDS)."""
    return tuple(name for name, f in FIELDS.items() if f.metadata["kind"] == kind)

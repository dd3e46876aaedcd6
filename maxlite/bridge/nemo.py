"""A maxlite recipe as Megatron-LM `pretrain_gpt.py` arguments and NeMo 2.0 recipe overrides.

    python -m maxlite.bridge.nemo RECIPE.yml [key=value ...] [--nodes 1] [--gpus-per-node 8]
                                  [--format both|megatron|nemo|json]

The mesh is resolved for nodes × gpus-per-node GPUs (Megatron's data parallel size is what is left
after tensor × pipeline). Whatever has no faithful equivalent is listed under "not mapped"; a model
Megatron's GPT layer cannot express at all (Gemma 3's post-norms and √d-scaled embeddings, a second
RoPE base for local layers) is refused in one line. Each layer kind says what Megatron expresses of
it (its `megatron` mapping in maxlite/bridge/nemo_kinds.py, or its refusal: maxlite/models/kinds.py);
the family's traits are mapped here, their refusals in one table. Flags and NeMo attributes of the
newer features (q/k norms, sliding windows, the score scale) are megatron-core's TransformerConfig
field names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any, Callable, Sequence

from maxlite import cli, config as C
from maxlite.bridge.nemo_kinds import Part
from maxlite.models.families import family
from maxlite.models.kinds import used_kinds

# maxlite preset → the NeMo 2.0 recipe factory (`llm.<name>.pretrain_recipe`) it corresponds to.
NEMO_FACTORIES = {
    "llama2-7b": "llama2_7b", "llama3-8b": "llama3_8b", "llama3.1-8b": "llama31_8b",
    "llama3.1-70b": "llama31_70b", "llama3.1-405b": "llama31_405b", "llama3.2-1b": "llama32_1b",
    "llama3.2-3b": "llama32_3b", "mistral-7b": "mistral_7b",
    "qwen2.5-0.5b": "qwen25_500m", "qwen2.5-1.5b": "qwen25_1p5b", "qwen2.5-7b": "qwen25_7b",
    "qwen2.5-14b": "qwen25_14b", "qwen2.5-32b": "qwen25_32b", "qwen2.5-72b": "qwen25_72b",
    "qwen3-0.6b": "qwen3_600m", "qwen3-1.7b": "qwen3_1p7b", "qwen3-4b": "qwen3_4b", "qwen3-8b": "qwen3_8b",
    "qwen3-14b": "qwen3_14b", "qwen3-32b": "qwen3_32b",
}
# Megatron's --use-rope-scaling hard-codes Llama 3.1's low/high frequency factors and context.
MEGATRON_ROPE_FIXED = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                       "rope_original_max_position": 8192}


@dataclasses.dataclass
class Mapping:
    megatron: list[tuple[str, Any]]  # (flag, value); value None for a store_true flag
    nemo: list[tuple[str, Any]]      # (dotted recipe attribute, python value)
    factory: str                     # NeMo recipe factory to start from
    factory_exact: bool              # False: only the closest one; every model key is overridden
    not_mapped: list[str]
    nodes: int
    gpus_per_node: int

    def megatron_argv(self) -> list[str]:
        argv = []
        for flag, value in self.megatron:
            argv.append(flag)
            if value is not None:
                argv.extend(str(v) for v in (value if isinstance(value, list) else [value]))
        return argv

    def megatron_dict(self) -> dict[str, Any]:
        return dict(self.megatron)


def _tokenizer_args(cfg) -> list[tuple[str, Any]]:
    """Megatron tokenizer flags for the recipe's tokenizer (synthetic data: a null tokenizer)."""
    if cfg.dataset_type == "synthetic":
        # NullTokenizer's vocabulary is --vocab-size ids plus one end-of-document id.
        return [("--mock-data", None), ("--tokenizer-type", "NullTokenizer"),
                ("--vocab-size", cfg.vocab_size - 1)]
    path = cfg.tokenizer_path
    if not path:
        from maxlite.data.tokenizer import BUNDLED_DIR
        return [("--tokenizer-type", "HuggingFaceTokenizer"), ("--tokenizer-model", str(BUNDLED_DIR))]
    if path.endswith(".model"):
        return [("--tokenizer-type", "SentencePieceTokenizer"), ("--tokenizer-model", path)]
    if path.endswith(("vocab.json", "merges.txt")):
        base = path.rsplit("/", 1)[0] if "/" in path else "."
        return [("--tokenizer-type", "GPT2BPETokenizer"), ("--vocab-file", f"{base}/vocab.json"),
                ("--merge-file", f"{base}/merges.txt")]
    return [("--tokenizer-type", "HuggingFaceTokenizer"), ("--tokenizer-model", path)]


def _data_args(cfg, notes: list[str]) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    mega, nemo = [], []
    if cfg.dataset_type == "text":
        notes.append("dataset_type=text: Megatron reads only .bin/.idx; preprocess the text first "
                     "(`python -m maxlite.data.preprocess`, the same format as Megatron's "
                     "tools/preprocess_data.py) and use dataset_type=indexed data_prefix=...")
        return mega, nemo
    if cfg.dataset_type != "indexed":
        nemo.append(("recipe.data", "run.Config(llm.MockDataModule, ...)"))
        return mega, nemo
    train = [x for w, p in cfg.blend("data_prefix") for x in (f"{w:g}", p)]
    paths = [x for w, p in cfg.blend("data_prefix") for x in (round(w, 6), p)]
    if cfg.eval_data_prefix:
        valid = [x for w, p in cfg.blend("eval_data_prefix") for x in (f"{w:g}", p)]
        mega += [("--train-data-path", train), ("--valid-data-path", valid)]
        nemo.append(("recipe.data.paths", {"train": paths, "validation": [
            x for w, p in cfg.blend("eval_data_prefix") for x in (round(w, 6), p)]}))
    else:
        mega += [("--data-path", train), ("--split", cfg.data_split)]
        nemo += [("recipe.data.paths", paths), ("recipe.data.split", cfg.data_split)]
    # maxlite restarts positions and masks attention at document boundaries inside a packed row,
    # and gives no loss to the target that crosses into the next document.
    mega += [("--reset-position-ids", None), ("--reset-attention-mask", None), ("--eod-mask-loss", None)]
    nemo += [("recipe.data.reset_position_ids", True), ("recipe.data.reset_attention_mask", True),
             ("recipe.data.eod_mask_loss", True), ("recipe.data.seed", cfg.data_shuffle_seed)]
    notes.append("data order: the blend and split map, but Megatron shuffles with its own "
                 "algorithm, so the sample order differs from maxlite's")
    return mega, nemo


def _schedule(cfg, notes: list[str]) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The --lr* flags that make Megatron's scheduler run optax's schedule (optim.py; checked step by
    step against megatron-core's OptimizerParamScheduler in the tests); a schedule it cannot run is
    refused in one line."""
    if cfg.alignment_sft_steps and cfg.alignment_sft_learning_rate:
        raise C.ConfigError(f"alignment_sft_steps={cfg.alignment_sft_steps} at alignment_sft_learning_rate="
                            f"{cfg.alignment_sft_learning_rate:g}, then a schedule over the rest: two phases "
                            f"Megatron's one --lr schedule cannot express; export the SFT recipe on its own")
    final = float(f"{cfg.learning_rate * cfg.learning_rate_final_fraction:.10g}")  # 3e-05, not 2.99…e-05
    min_lr = cfg.learning_rate if cfg.lr_schedule_type == "constant" else final
    wsd = cfg.lr_schedule_type == "wsd"
    mega = [("--lr", cfg.learning_rate), ("--min-lr", min_lr),
            ("--lr-decay-style", "WSD" if wsd else cfg.lr_schedule_type), ("--lr-warmup-iters", cfg.warmup_steps),
            ("--lr-decay-iters", cfg.schedule_steps), ("--train-iters", cfg.steps)]
    nemo = [("recipe.trainer.max_steps", cfg.steps), ("recipe.optim.config.lr", cfg.learning_rate)]
    if wsd:  # megatron-core's scheduler: the peak until --lr-decay-iters minus these, then the decay
        mega += [("--lr-wsd-decay-style", {"1-sqrt": "minus_sqrt"}.get(cfg.wsd_decay_style, cfg.wsd_decay_style)),
                 ("--lr-wsd-decay-iters", cfg.wsd_decay_steps)]
        notes.append("lr_schedule_type=wsd: NeMo's recipe schedulers have no warmup-stable-decay; the NeMo "
                     "recipe keeps the warmup and holds the peak (its decay is not mapped); the Megatron "
                     "flags run the whole schedule")
    scheduler = {"cosine": "CosineAnnealingScheduler", "linear": "PolynomialDecayAnnealingScheduler",
                 "constant": "WarmupHoldPolicyScheduler", "wsd": "WarmupHoldPolicyScheduler"}[cfg.lr_schedule_type]
    nemo.append(("recipe.optim.lr_scheduler", f"run.Config(nemo.lightning.pytorch.optim.{scheduler})"))
    nemo += [("recipe.optim.lr_scheduler.warmup_steps", cfg.warmup_steps),
             ("recipe.optim.lr_scheduler.max_steps", cfg.schedule_steps)]
    if cfg.lr_schedule_type == "cosine":
        nemo += [("recipe.optim.lr_scheduler.constant_steps", 0),
                 ("recipe.optim.lr_scheduler.min_lr", min_lr)]
    elif cfg.lr_schedule_type == "linear":
        nemo += [("recipe.optim.lr_scheduler.power", 1.0), ("recipe.optim.lr_scheduler.min_lr", min_lr)]
    else:
        nemo.append(("recipe.optim.lr_scheduler.hold_steps", max(cfg.schedule_steps - cfg.warmup_steps, 0)))
    return mega, nemo


def _optimizer(cfg, notes: list[str]) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    mega = [("--optimizer", "adam"), ("--weight-decay", cfg.adam_weight_decay),
            ("--adam-beta1", cfg.adam_b1), ("--adam-beta2", cfg.adam_b2), ("--adam-eps", cfg.adam_eps),
            ("--clip-grad", cfg.gradient_clipping_threshold)]
    nemo = [("recipe.optim.config.optimizer", "adam"),
            ("recipe.optim.config.weight_decay", cfg.adam_weight_decay),
            ("recipe.optim.config.adam_beta1", cfg.adam_b1), ("recipe.optim.config.adam_beta2", cfg.adam_b2),
            ("recipe.optim.config.adam_eps", cfg.adam_eps),
            ("recipe.optim.config.clip_grad", cfg.gradient_clipping_threshold)]
    if cfg.opt_type == "muon":
        mega[0], nemo[0] = ("--optimizer", "muon"), ("recipe.optim.config.optimizer", "muon")
        muon = _muon(cfg)
        mega += [(f"--{k.replace('_', '-')}", None if v is True else v) for k, v in muon]  # True: a bare flag
        nemo += [(f"recipe.optim.config.{k}", v) for k, v in muon]
    if cfg.dtype == "bfloat16":
        mega.append(("--bf16", None))
        nemo += [("recipe.optim.config.bf16", True), ("recipe.trainer.plugins.precision", "bf16-mixed")]
    else:
        nemo += [("recipe.optim.config.bf16", False), ("recipe.trainer.plugins.precision", "32")]
    if cfg.weight_dtype == "bfloat16":
        notes.append("weight_dtype=bfloat16: Megatron keeps float32 main weights and Adam state with "
                     "--bf16; pure bfloat16 parameters have no direct flag")
    low = [f"{k}=bfloat16" for k, v in (("mu_dtype", cfg.first_moment_dtype), ("grad_dtype", cfg.grad_dtype))
           if v == "bfloat16" and cfg.weight_dtype == "float32"]
    if low:
        notes.append(f"{' '.join(low)}: not exported; Megatron's counterparts are --use-precision-aware-optimizer "
                     "with --exp-avg-dtype bf16 and --main-grads-dtype bf16")
    if cfg.z_loss_weight > 0:
        notes.append(f"z_loss_weight={cfg.z_loss_weight}: Megatron's GPT loss has no z-loss "
                     "(only the MoE router has one); dropped")
    return mega, nemo


def _muon(cfg) -> list[tuple[str, Any]]:
    """megatron-core's Muon settings (OptimizerConfig's names) that run optax's: Nesterov momentum,
    five Newton-Schulz steps, the update scaled by its matrix's shape (optax's default, Megatron's
    shape_scaling) or to a consistent RMS (Megatron's spectral scale times an extra factor)."""
    if cfg.muon_weight_decay != cfg.adam_weight_decay:
        raise C.ConfigError(f"muon_weight_decay={cfg.muon_weight_decay:g} differs from adam_weight_decay="
                            f"{cfg.adam_weight_decay:g}: Megatron's Muon has one --weight-decay for both; "
                            f"set them equal to export")
    scale = [("muon_scale_mode", "spectral"), ("muon_extra_scale_factor", cfg.muon_consistent_rms)] \
        if cfg.muon_consistent_rms else [("muon_scale_mode", "shape_scaling")]
    return [("muon_momentum", cfg.muon_beta), ("muon_use_nesterov", True), ("muon_num_ns_steps", 5), *scale]


# What Megatron-LM's GPT layer cannot express of the family's traits and of the model keys outside
# the layer kinds (each kind says its own), listed in this order after the kinds' lines.
REFUSED_TRAITS: tuple[tuple[Callable[[Any, Any], Any], str], ...] = (
    (lambda cfg, fam: fam.post_norms, "norms after attention and after the MLP"),
    (lambda cfg, fam: not fam.pre_norms, "no norm before attention and the MLP"),
    (lambda cfg, fam: fam.qk_norm_heads, "q/k norms over every head at once (Megatron's qk_layernorm is per head)"),
    (lambda cfg, fam: fam.embed_scale, "embeddings scaled by sqrt(emb_dim)"),
    (lambda cfg, fam: fam.mlp == "geglu", "a GeGLU MLP (--swiglu is SiLU)"),
    (lambda cfg, fam: cfg.sliding_window and cfg.local_rope_max_timescale,
     "a second RoPE base for the sliding-window layers"),
    (lambda cfg, fam: cfg.mtp_num_layers, "multi-token prediction (not mapped yet: --mtp-num-layers)"),
    (lambda cfg, fam: fam.rope and cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type == "yarn",
     "YaRN RoPE scaling (Megatron's GPT layer takes rope or llama3 scaling)"),
    (lambda cfg, fam: fam.attn_output_gate, "an attention output gate"),
    (lambda cfg, fam: fam.mlp == "clamped_swiglu", "gpt-oss's clamped SwiGLU"),
    (lambda cfg, fam: fam.mlp == "limited_swiglu", "DeepSeek-V4's clamped SwiGLU"),
    (lambda cfg, fam: cfg.hc_mult, "hyper-connections (hc_mult: a residual of several streams)"),
)


def kind_parts(cfg, notes: list[str]) -> list[Part]:
    """What Megatron expresses of each kind the model's layers use (feed-forwards first, then mixers):
    its mapping, or a part holding only its refusal."""
    parts = []
    for kind in used_kinds(cfg):
        mapping = kind.megatron_function()
        parts.append(mapping(cfg, notes) if mapping else Part(refused=[kind.megatron_refusal]))
    return parts


def inexpressible(cfg, parts: list[Part]) -> list[str]:
    """What Megatron-LM's GPT layer cannot express of this model: its kinds' lines (`parts`), then
    its traits', each once."""
    fam = family(cfg)
    lines = [line for part in parts for line in part.refused]
    return list(dict.fromkeys(lines + [line for refused, line in REFUSED_TRAITS if refused(cfg, fam)]))


def _model(cfg, tp: int, notes: list[str]) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    fam = family(cfg)
    parts = kind_parts(cfg, notes)
    missing = inexpressible(cfg, parts)
    if missing:
        raise C.ConfigError(f"decoder_block={cfg.decoder_block}: Megatron-LM's GPT model cannot express "
                            f"{', '.join(missing)}; train it with maxlite, or use NeMo's or Megatron-Bridge's "
                            f"own recipes for this family")
    m = "recipe.model.config."
    max_pos = max(cfg.max_position_embeddings, cfg.max_target_length)
    mega = [("--num-layers", cfg.base_num_decoder_layers), ("--hidden-size", cfg.base_emb_dim)]
    nemo = [(m + "num_layers", cfg.base_num_decoder_layers), (m + "hidden_size", cfg.base_emb_dim)]
    for part in parts:  # the layers' kinds: MLP width, heads, q/k norms, windows, the score scale
        mega += part.megatron
        nemo += [(m + field, value) for field, value in part.nemo]
    mega += [("--seq-length", cfg.max_target_length), ("--max-position-embeddings", max_pos)]
    nemo += [(m + "seq_length", cfg.max_target_length), ("recipe.data.seq_length", cfg.max_target_length)]
    # each trait on its own: positions, the norm, the MLP
    norm = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}[fam.norm]
    mega.append(("--normalization", norm))
    nemo.append((m + "normalization", norm))
    if fam.mlp == "gelu":
        mega.append(("--openai-gelu", None))  # maxlite's GELU is the tanh approximation
        nemo += [(m + "gated_linear_unit", False),
                 (m + "activation_func", 'functools.partial(torch.nn.functional.gelu, approximate="tanh")')]
    else:  # swiglu (geglu and clamped SwiGLU are refused above)
        mega.append(("--swiglu", None))
        nemo += [(m + "gated_linear_unit", True), (m + "activation_func", "torch.nn.functional.silu")]
    if fam.positions == "none":  # no positions (Nemotron-H, Kimi Linear: NoPE)
        mega.append(("--position-embedding-type", "none"))
        nemo.append((m + "position_embedding_type", "none"))
    elif not fam.rope:  # learned absolute positions
        mega.append(("--position-embedding-type", "learned_absolute"))
        nemo += [(m + "position_embedding_type", "learned_absolute"), (m + "max_position_embeddings", max_pos)]
    else:
        mega += [("--position-embedding-type", "rope"), ("--rotary-base", int(cfg.rope_max_timescale)),
                 ("--rotary-percent", cfg.partial_rotary_factor)]
        nemo += [(m + "position_embedding_type", "rope"), (m + "rotary_base", int(cfg.rope_max_timescale)),
                 (m + "rotary_percent", cfg.partial_rotary_factor)]
        if cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type == "linear":  # positions ÷ factor
            mega.append(("--rotary-seq-len-interpolation-factor", int(cfg.rope_scaling_factor)))
            nemo.append((m + "seq_len_interpolation_factor", int(cfg.rope_scaling_factor)))
            if not float(cfg.rope_scaling_factor).is_integer():
                notes.append(f"rope_scaling_factor={cfg.rope_scaling_factor}: Megatron's interpolation factor "
                             f"is an integer; rounded down")
        elif cfg.rope_scaling_factor > 0:
            mega += [("--use-rope-scaling", None), ("--rope-scaling-factor", cfg.rope_scaling_factor)]
            nemo += [(m + "scale_factor", cfg.rope_scaling_factor),
                     (m + "low_freq_factor", cfg.rope_low_freq_factor),
                     (m + "high_freq_factor", cfg.rope_high_freq_factor),
                     (m + "old_context_len", cfg.rope_original_max_position)]
            changed = [f"{k}={getattr(cfg, k)}" for k, v in MEGATRON_ROPE_FIXED.items() if getattr(cfg, k) != v]
            if changed:
                notes.append(f"{', '.join(changed)}: Megatron's --use-rope-scaling fixes these at "
                             f"Llama 3.1's 1.0/4.0/8192 (NeMo's Llama31Config takes them)")
    mega.append(("--norm-epsilon", cfg.normalization_layer_epsilon))
    nemo.append((m + "layernorm_epsilon", cfg.normalization_layer_epsilon))
    if not cfg.logits_via_embedding:
        mega.append(("--untie-embeddings-and-output-weights", None))
    nemo.append((m + "share_embeddings_and_output_weights", bool(cfg.logits_via_embedding)))
    if not (cfg.use_bias and fam.biases == "all"):  # no MLP biases: Megatron's linear biases off
        mega.append(("--disable-bias-linear", None))
    nemo.append((m + "add_bias_linear", bool(cfg.use_bias and fam.biases == "all")))
    mega += [("--init-method-std", cfg.init_scale), ("--attention-dropout", 0.0),
             ("--hidden-dropout", 0.0), ("--attention-softmax-in-fp32", None),
             # pad the vocabulary to exactly vocab_size (Megatron pads to a multiple of this × TP)
             ("--make-vocab-size-divisible-by", math.gcd(cfg.vocab_size // tp, 128))]
    nemo += [(m + "init_method_std", cfg.init_scale), (m + "attention_dropout", 0.0),
             (m + "hidden_dropout", 0.0),
             (m + "make_vocab_size_divisible_by", math.gcd(cfg.vocab_size // tp, 128))]
    return mega, nemo


def _parallel(cfg, nodes: int, gpus: int, notes: list[str]):
    fsdp, context, tensor, stages = (cfg.axis_size(a) for a in ("fsdp", "context", "tensor", "stage"))  # MoE recipes are refused (_model)
    # one Megatron DP rank = one tensor × context × pipeline group; its micro-batch is one of our
    # pipeline's (num_pipeline_microbatches of them per batch shard)
    mbs = cfg.per_device_batch_size * tensor * context * stages / (cfg.pipeline_microbatches if stages > 1 else 1)
    if abs(mbs - round(mbs)) > 1e-9:
        notes.append(f"per_device_batch_size={cfg.per_device_batch_size} × tensor {tensor} × context {context} "
                     f"is not a whole micro-batch per Megatron data-parallel rank; rounded up")
    mbs = max(1, math.ceil(mbs - 1e-9))
    mega = [("--tensor-model-parallel-size", tensor), ("--pipeline-model-parallel-size", stages),
            ("--context-parallel-size", context),
            ("--global-batch-size", cfg.global_batch_size), ("--micro-batch-size", mbs),
            ("--seed", cfg.seed), ("--log-interval", cfg.log_period)]
    nemo = [("recipe.trainer.num_nodes", nodes), ("recipe.trainer.devices", gpus),
            ("recipe.trainer.strategy.tensor_model_parallel_size", tensor),
            ("recipe.trainer.strategy.pipeline_model_parallel_size", stages),
            ("recipe.trainer.strategy.context_parallel_size", context),
            ("recipe.data.global_batch_size", cfg.global_batch_size),
            ("recipe.data.micro_batch_size", mbs), ("recipe.trainer.log_every_n_steps", cfg.log_period)]
    if cfg.pipeline_repeats > 1:  # the circular schedule: Megatron's interleaved (virtual) stages
        mega.append(("--num-layers-per-virtual-pipeline-stage",
                     cfg.base_num_decoder_layers // (stages * cfg.pipeline_repeats)))
        nemo.append(("recipe.trainer.strategy.virtual_pipeline_model_parallel_size", cfg.pipeline_repeats))
    if fsdp > 1:
        mega.append(("--use-distributed-optimizer", None))
        nemo.append(("recipe.optim.config.use_distributed_optimizer", True))
        notes.append(f"fsdp={fsdp}: Megatron runs it as data parallel with --use-distributed-optimizer "
                     f"(optimizer state sharded, parameters replicated: ZeRO-1, not full FSDP)")
    if cfg.gradient_accumulation_steps > 1:
        notes.append(f"gradient_accumulation_steps={cfg.gradient_accumulation_steps}: implied by "
                     f"Megatron (global batch / (micro batch × data parallel))")
    policy = cfg.remat_policy
    if policy == "full":
        mega += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                 ("--recompute-num-layers", 1)]
        nemo += [("recipe.model.config.recompute_granularity", "full"),
                 ("recipe.model.config.recompute_method", "uniform"),
                 ("recipe.model.config.recompute_num_layers", 1)]
    elif policy in ("minimal", "save_dots"):
        mega.append(("--recompute-granularity", "selective"))
        nemo.append(("recipe.model.config.recompute_granularity", "selective"))
        notes.append(f"remat_policy={policy}: approximated by Megatron's selective recompute "
                     f"(recomputes the attention core only); XLA policy names do not map")
    notes.append("scan_layers: a JAX compile-time choice; nothing to map")
    return mega, nemo


def _eval_and_checkpoints(cfg, notes: list[str]):
    every = getattr(cfg, "eval_interval", 0)
    if every > 0:
        mega = [("--eval-interval", every), ("--eval-iters", cfg.eval_steps)]
        nemo = [("recipe.trainer.val_check_interval", every),
                ("recipe.trainer.limit_val_batches", cfg.eval_steps)]
    else:
        mega, nemo = [("--eval-iters", 0)], [("recipe.trainer.limit_val_batches", 0)]
    period = getattr(cfg, "checkpoint_period", 0)
    if getattr(cfg, "enable_checkpointing", False) and period > 0:
        mega.append(("--save-interval", period))
        nemo.append(("recipe.log.ckpt.every_n_train_steps", period))
        if getattr(cfg, "checkpoint_keep_best_k", 0) > 0:
            nemo.append(("recipe.log.ckpt.save_top_k", cfg.checkpoint_keep_best_k))
        notes.append("checkpoints: Megatron/NeMo write their own format (add --save/--load DIR); move "
                     "weights between the two with `python -m maxlite.bridge.hf` (HF safetensors)")
    return mega, nemo


def map_recipe(cfg, nodes: int = 1, gpus_per_node: int = 8) -> Mapping:
    """A resolved (or resolvable) Config → its Megatron-LM / NeMo 2.0 equivalent."""
    cfg = C.resolve(cfg, nodes * gpus_per_node, 1, nodes)
    notes: list[str] = []
    tensor = cfg.axis_size("tensor")
    model_m, model_n = _model(cfg, tensor, notes)
    par_m, par_n = _parallel(cfg, nodes, gpus_per_node, notes)
    opt_m, opt_n = _optimizer(cfg, notes)
    lr_m, lr_n = _schedule(cfg, notes)
    tok_m = _tokenizer_args(cfg)
    data_m, data_n = _data_args(cfg, notes)
    ckpt_m, ckpt_n = _eval_and_checkpoints(cfg, notes)
    factory = NEMO_FACTORIES.get(cfg.model_name)
    closest = family(cfg).nemo_factory
    return Mapping(megatron=model_m + par_m + opt_m + lr_m + tok_m + data_m + ckpt_m,
                   nemo=model_n + par_n + opt_n + lr_n + data_n + ckpt_n, factory=factory or closest,
                   factory_exact=factory is not None, not_mapped=notes, nodes=nodes,
                   gpus_per_node=gpus_per_node)


def _megatron_text(m: Mapping) -> str:
    lines = [f"# Megatron-LM equivalent ({m.nodes} node(s) × {m.gpus_per_node} GPUs)",
             f"torchrun --nnodes {m.nodes} --nproc-per-node {m.gpus_per_node} pretrain_gpt.py \\"]
    for flag, value in m.megatron:
        if value is None:
            text = flag
        else:
            text = f"{flag} " + " ".join(str(v) for v in (value if isinstance(value, list) else [value]))
        lines.append(f"    {text} \\")
    lines[-1] = lines[-1].removesuffix(" \\")
    return "\n".join(lines)


def _nemo_text(m: Mapping) -> str:
    how = "then" if m.factory_exact else "(the closest recipe; every model key is overridden), then"
    lines = [f"# NeMo 2.0: recipe = llm.{m.factory}.pretrain_recipe(num_nodes={m.nodes}, "
             f"num_gpus_per_node={m.gpus_per_node}) {how}:"]
    for key, value in m.nemo:
        literal = value if isinstance(value, str) and value.startswith(("run.", "torch.", "functools.")) \
            else repr(value)
        lines.append(f"{key}={literal}")
    return "\n".join(lines)


def render(m: Mapping, fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"megatron_args": m.megatron_argv(), "nemo_factory": m.factory,
                           "nemo_factory_exact": m.factory_exact,
                           "nemo_overrides": {k: v for k, v in m.nemo}, "not_mapped": m.not_mapped,
                           "nodes": m.nodes, "gpus_per_node": m.gpus_per_node}, indent=2)
    parts = []
    if fmt in ("both", "megatron"):
        parts.append(_megatron_text(m))
    if fmt in ("both", "nemo"):
        parts.append(_nemo_text(m))
    parts.append("# not mapped (or only approximately):\n" + "\n".join(f"#   - {n}" for n in m.not_mapped))
    return "\n\n".join(parts)


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxlite.bridge.nemo", description=__doc__.split("\n")[0])
    parser.add_argument("recipe", nargs="+", help="RECIPE.yml [key=value ...] (as for maxlite.train)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--format", choices=("both", "megatron", "nemo", "json"), default="both")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise C.ConfigError("--nodes and --gpus-per-node must be positive")
    mapping = map_recipe(C.load(args.recipe), args.nodes, args.gpus_per_node)
    print(render(mapping, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())

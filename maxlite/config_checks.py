"""What each value of a Config may be: choices, ranges, and the checks across keys (a MoE layout,
an alignment objective's data, the data source's keys, resilience, storage, launchers) that need no
device count: `config.load` runs `validate` on every Config it builds. And what the devices' layout
needs once `config.resolve` has filled the mesh: `check_layout`, which resolve runs."""

from __future__ import annotations

import re

from maxlite.config import (_DEFAULTS, FILE_DATASETS, MESH_AXES, OBJECTIVE_DATASET, PATH_LIST_KEYS, SOURCE_KEYS,
                            STORAGE_SCHEMES, Config, ConfigError, parse_max_time, parse_signals, parse_split,
                            sequence_pieces)
from maxlite.models import names
from maxlite.models.families import FAMILIES
from maxlite.models.kinds import check_layer_types

_CHOICES = {
    "decoder_block": tuple(FAMILIES),
    "dtype": ("float32", "bfloat16"),
    "weight_dtype": ("float32", "bfloat16"),
    "remat_policy": names.REMAT_POLICIES,
    "attention": names.ATTENTION,
    "moe_implementation": names.MOE_IMPLEMENTATIONS,
    "routed_score_func": ("softmax", "sigmoid"),
    "quantization": names.QUANTIZATION,
    "rope_scaling_type": ("llama3", "linear"),
    "lr_schedule_type": ("cosine", "linear", "constant", "wsd"),
    "wsd_decay_style": ("linear", "cosine", "1-sqrt"),
    "opt_type": ("adamw", "muon"),
    "checkpoint_error_policy": ("continue", "stop"),
    "fault_type": ("", "crash", "hang", "slow", "starve", "sigterm", "crash_in_snapshot", "crash_in_checkpoint", "nan", "pause"),
    "inmemory_snapshot_keeper": ("auto", "shm", "ray"),
    "dataset_type": ("synthetic", "text", "indexed", "sft", "preference", "prompts"),
    "train_objective": ("lm", "dpo", "grpo"),
    "sft_template": ("auto", "llama3", "chatml"),
    "data_bad_record_policy": ("skip", "error"),
    "loggers": ("wandb", "mlflow"),  # a list: each item is checked
    "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),  # a list
    "wandb_mode": ("", "online", "offline", "disabled"),
    "profiler": ("", "xplane"),
}

# Legal types, nonsense values: inclusive [low, high] (None: unbounded). `_POSITIVE` keys must be > 0.
_RANGES: dict[str, tuple[float | None, float | None]] = {
    "learning_rate": (0, None), "learning_rate_final_fraction": (0, 1), "warmup_steps_fraction": (0, 1),
    "learning_rate_schedule_steps": (-1, None), "wsd_decay_steps_fraction": (0, 1), "lr_warmup_steps": (-1, None),
    "muon_beta": (0, 1), "muon_weight_decay": (0, None), "muon_consistent_rms": (0, None),
    "adam_b1": (0, 1), "adam_b2": (0, 1), "adam_weight_decay": (0, None),
    "gradient_clipping_threshold": (0, None), "z_loss_weight": (0, None), "seed": (0, None),
    "checkpoint_period": (0, None), "max_num_checkpoints_to_keep": (0, None),
    "checkpoint_keep_best_k": (0, None), "eval_interval": (0, None), "eval_steps": (0, None),
    "max_restarts": (-1, None), "run_lease_seconds": (0, None), "data_shuffle_window": (1, None),
    "packing_bins": (1, None), "grain_worker_count": (0, None), "grain_threads": (0, None),
    "grain_prefetch": (0, None), "straggler_threshold": (0, 1), "watchdog_factor": (1, None),
    "watchdog_min_timeout": (0, None), "watchdog_initial_timeout": (0, None),
    "preemption_grace_seconds": (0, None), "resilience_sync_period": (1, None),
    "inmemory_snapshot_period": (0, None), "inmemory_snapshot_max_bytes": (0, None),
    "fault_pause_seconds": (0, None), "spike_max_rollbacks": (0, None), "fault_slowdown_factor": (1, None),
    "ray_min_workers": (0, None), "elastic_wait_seconds": (1, None), "spike_factor": (0, None), "spike_patience": (1, None),
    "sample_every_steps": (0, None), "sample_max_new_tokens": (1, None), "sample_temperature": (0, None),
    "sample_top_k": (0, None), "sft_audit_records": (1, None), "sft_audit_examples": (0, None),
    "skip_first_n_steps_for_profiler": (1, None), "profiler_steps": (1, None),
    "lora_rank": (0, None), "alignment_sft_steps": (0, None), "alignment_sft_learning_rate": (0, None), "dpo_beta": (0, None),
    "dpo_label_smoothing": (0, 0.499), "grpo_beta": (0, None), "grpo_epsilon": (0, None),
    "sliding_window": (0, None), "local_rope_max_timescale": (0, None), "query_pre_attn_scalar": (0, None),
}
_POSITIVE = ("steps", "max_target_length", "base_emb_dim", "base_num_decoder_layers",
             "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "head_dim",
             "vocab_size", "gradient_accumulation_steps", "log_period", "per_device_batch_size",
             "adam_eps", "normalization_layer_epsilon", "rope_max_timescale", "init_scale",
             "grpo_num_generations", "grpo_max_new_tokens", "grpo_temperature", "grpo_iterations")


def validate(c: Config) -> None:
    """Checks that need no device count."""
    for key, choices in _CHOICES.items():
        value = getattr(c, key)
        for item in (value if isinstance(value, (list, tuple)) else (value,)):
            if item not in choices:
                names = ", ".join(x or '""' for x in choices)
                raise ConfigError(f"{key}={item!r}: choose one of {names}")
    for key in _POSITIVE:
        if getattr(c, key) <= 0:
            raise ConfigError(f"{key}={getattr(c, key)} must be positive")
    for key, (low, high) in _RANGES.items():
        value = getattr(c, key)
        if (low is not None and value < low) or (high is not None and value > high):
            where = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(f"{key}={value} must be {where}")
    if c.learning_rate_schedule_steps == 0:
        raise ConfigError("learning_rate_schedule_steps=0: give the schedule's length, or -1 for `steps`")
    if c.lr_schedule_type == "wsd" and c.warmup_steps + c.wsd_decay_steps > c.schedule_steps:
        raise ConfigError(f"lr_schedule_type=wsd: warmup ({c.warmup_steps} steps) + decay ({c.wsd_decay_steps}) "
                          f"exceed the schedule's {c.schedule_steps} steps; shorten one or raise steps")
    if 0 < c.spike_factor <= 1:
        raise ConfigError(f"spike_factor={c.spike_factor}: a spike is a loss above this × the recent median; "
                          f"use a factor above 1 (2–4 is usual), or 0 to judge non-finite losses only")
    if c.checkpoint_keep_best_k and not c.eval_interval:
        raise ConfigError("checkpoint_keep_best_k needs eval_interval > 0 (it ranks by eval loss)")
    if c.load_parameters_path and c.load_full_state_path:
        raise ConfigError("set load_parameters_path or load_full_state_path, not both")
    if c.base_num_query_heads % c.base_num_kv_heads:
        raise ConfigError(
            f"base_num_query_heads={c.base_num_query_heads} must be a multiple of "
            f"base_num_kv_heads={c.base_num_kv_heads}")
    if FAMILIES[c.decoder_block].positions == "learned" and c.max_target_length > c.max_position_embeddings:
        raise ConfigError(
            f"max_target_length={c.max_target_length} exceeds max_position_embeddings="
            f"{c.max_position_embeddings} of this model (learned positions)")
    if c.num_vocab_tiling == 0 or c.num_vocab_tiling < -1 or (
            c.num_vocab_tiling > 0 and c.max_target_length % c.num_vocab_tiling):
        raise ConfigError(f"num_vocab_tiling={c.num_vocab_tiling} must be -1 (auto) or a positive "
                          f"divisor of max_target_length={c.max_target_length}")
    for key in ("attention_block_size", *(k for k in _DEFAULTS if k.startswith("sa_block_"))):
        if getattr(c, key) <= 0:
            raise ConfigError(f"{key}={getattr(c, key)} must be positive")
    if c.max_segments_per_seq < 0:
        raise ConfigError(f"max_segments_per_seq={c.max_segments_per_seq} must be >= 0 "
                          "(0 = cudnn_flash always takes the dense mask)")
    if c.attention == "blockwise" and c.max_target_length % min(c.attention_block_size,
                                                                c.max_target_length):
        raise ConfigError(f"attention_block_size={c.attention_block_size} must divide "
                          f"max_target_length={c.max_target_length}")
    _validate_moe(c)
    _validate_objective(c)
    _validate_data(c)
    _validate_resilience(c)
    _validate_storage(c)
    _validate_launch(c)
    if not 0 <= c.lora_dropout < 1:
        raise ConfigError(f"lora_dropout={c.lora_dropout} must be in [0, 1)")
    layer_types = check_layer_types(c.layer_types, c.base_num_decoder_layers)
    if layer_types:
        raise ConfigError(layer_types)
    if c.local_rope_max_timescale and not c.sliding_window:
        raise ConfigError(f"local_rope_max_timescale={c.local_rope_max_timescale} is the RoPE base of "
                          f"sliding-window layers: set sliding_window too, or leave it 0")
    if c.lora_rank:
        if not FAMILIES[c.decoder_block].gated:
            raise ConfigError(f"lora_rank={c.lora_rank}: LoRA is available for gated-MLP families "
                              f"({', '.join(f.name for f in FAMILIES.values() if f.gated)}), not {c.decoder_block}")
        if c.lora_alpha <= 0 or not c.lora_targets:
            raise ConfigError("LoRA needs lora_alpha > 0 and at least one of lora_targets")
        mlp = [t for t in c.lora_targets if t in ("gate_proj", "up_proj", "down_proj")]
        if FAMILIES[c.decoder_block].moe and (mlp or c.first_num_dense_layers or c.interleave_moe_layer_step != 1):
            raise ConfigError(f"lora_rank={c.lora_rank} on a mixture of experts adapts the attention projections "
                              f"of models whose every layer is MoE: set lora_targets=[q_proj,k_proj,v_proj,o_proj]"
                              f" (not {', '.join(mlp) or 'dense layers apart'})")
    for prefix in ("ici", "dcn"):
        values = c.parallelism(prefix)
        if values.count(-1) > 1:
            raise ConfigError(f"only one {prefix}_*_parallelism may be -1, got {values}")
        if any(v == 0 or v < -1 for v in values):
            raise ConfigError(f"{prefix}_*_parallelism must be positive or -1, got {values}")


def _validate_moe(c: Config) -> None:
    """The mixture-of-experts keys (maxlite/models/moe.py) against the family."""
    moe = FAMILIES[c.decoder_block].moe
    if not moe:
        if c.num_experts:
            names_ = ", ".join(f.name for f in FAMILIES.values() if f.moe)
            raise ConfigError(f"num_experts={c.num_experts}: decoder_block={c.decoder_block} has a dense MLP; "
                              f"mixtures of experts are the families {names_}")
        return
    if c.num_experts < 1 or c.base_moe_mlp_dim < 1:
        raise ConfigError(f"decoder_block={c.decoder_block} needs num_experts and base_moe_mlp_dim > 0, got "
                          f"{c.num_experts} and {c.base_moe_mlp_dim}")
    if not 1 <= c.num_experts_per_tok <= c.num_experts:
        raise ConfigError(f"num_experts_per_tok={c.num_experts_per_tok} must be in [1, num_experts={c.num_experts}]")
    if c.shared_experts < 0:
        raise ConfigError(f"shared_experts={c.shared_experts} must be >= 0")
    rest = c.base_num_decoder_layers - c.first_num_dense_layers
    if c.first_num_dense_layers < 0 or rest < 1:
        raise ConfigError(f"first_num_dense_layers={c.first_num_dense_layers} must leave at least one of the "
                          f"{c.base_num_decoder_layers} layers for the experts")
    if c.interleave_moe_layer_step < 1 or rest % c.interleave_moe_layer_step:
        raise ConfigError(f"interleave_moe_layer_step={c.interleave_moe_layer_step} must divide the "
                          f"{rest} layers after first_num_dense_layers")
    if c.capacity_factor <= 0 and c.capacity_factor != -1:
        raise ConfigError(f"capacity_factor={c.capacity_factor}: -1 (dropless) or > 0")
    if c.moe_implementation == "capacity" and c.capacity_factor <= 0:
        raise ConfigError("moe_implementation=capacity drops what exceeds an expert's capacity: set "
                          "capacity_factor > 0 (e.g. 1.25), or pick a dropless implementation")
    if c.load_balance_loss_weight < 0 or c.router_z_loss_weight < 0:
        raise ConfigError("load_balance_loss_weight and router_z_loss_weight must be >= 0")


def _validate_objective(c: Config) -> None:
    """train_objective against the data it reads and the keys it needs (maxlite/objectives/)."""
    want = OBJECTIVE_DATASET.get(c.train_objective)
    if want and c.dataset_type != want:
        raise ConfigError(f"train_objective={c.train_objective} reads dataset_type={want}, not {c.dataset_type}")
    if not want and c.dataset_type in OBJECTIVE_DATASET.values():
        objective = next(k for k, v in OBJECTIVE_DATASET.items() if v == c.dataset_type)
        raise ConfigError(f"dataset_type={c.dataset_type} is for train_objective={objective}")
    if not want and (c.alignment_sft_steps or c.alignment_sft_learning_rate):
        raise ConfigError("alignment_sft_steps and alignment_sft_learning_rate are for train_objective=dpo or grpo")
    if c.dpo_precompute_reference and c.train_objective != "dpo":
        raise ConfigError("dpo_precompute_reference is for train_objective=dpo")
    if c.dpo_precompute_reference and c.alignment_sft_steps:
        raise ConfigError("dpo_precompute_reference computes the reference from the weights the run starts "
                          "with: set alignment_sft_steps=0 and start from an SFT checkpoint (load_parameters_path)")
    if c.train_objective != "grpo":
        return
    if not c.reward_functions:
        raise ConfigError("train_objective=grpo needs reward_functions, e.g. [maxlite.objectives.rewards:exact_answer]")
    for name in c.reward_functions:
        module, _, attr = str(name).partition(":")
        if not re.fullmatch(r"[A-Za-z_][\w.]*", module) or not attr.isidentifier():
            raise ConfigError(f"reward_functions: {name!r} is not 'package.module:function'")
    if c.reward_weights and len(c.reward_weights) != len(c.reward_functions):
        raise ConfigError(f"reward_weights has {len(c.reward_weights)} values for "
                          f"{len(c.reward_functions)} reward_functions")
    if c.grpo_max_new_tokens >= c.max_target_length:
        raise ConfigError(f"grpo_max_new_tokens={c.grpo_max_new_tokens} leaves no room for the prompt in "
                          f"max_target_length={c.max_target_length}")
    if c.grpo_num_generations < 2:
        raise ConfigError("grpo_num_generations must be at least 2 (advantages are relative to the group)")


def _validate_data(c: Config) -> None:
    """The data source's keys: each read by the chosen source (else refused), each well-formed."""
    for key, sources in SOURCE_KEYS.items():
        if c.dataset_type not in sources and getattr(c, key) != Config.__dataclass_fields__[key].default:
            raise ConfigError(f"{key} is read by dataset_type={' or '.join(sources)}, but this run reads "
                              f"dataset_type={c.dataset_type}: remove {key} or change dataset_type")
    if c.dataset_type == "indexed":
        parse_split(c.data_split)
        if not c.data_prefix:
            raise ConfigError("dataset_type=indexed needs data_prefix=[w1,prefix1,...] "
                              "(make one with python -m maxlite.data.preprocess)")
    if c.dataset_type in FILE_DATASETS and c.eval_interval > 0 and c.dataset_path and not c.eval_dataset_path:
        raise ConfigError(f"dataset_type={c.dataset_type} with your own dataset_path and eval_interval > 0: "
                          f"set eval_dataset_path for evaluation on your own data (or eval_interval=0)")
    for key in PATH_LIST_KEYS:
        if "://" in getattr(c, key):
            raise ConfigError(f"{key}: remote text is not read directly; copy it locally, or preprocess it "
                              f"to .bin/.idx and use dataset_type=indexed (gs:// is staged)")


def _validate_resilience(c: Config) -> None:
    parse_max_time(c.max_time)
    parse_signals(c.preemption_signals)
    if c.fault_type and c.fault_step < 0:
        raise ConfigError(f"fault_type={c.fault_type} needs fault_step >= 0 (the step it fires at)")


def _validate_storage(c: Config) -> None:
    """Where a run writes: local paths or gs://BUCKET/..., nothing else."""
    for key in ("base_output_directory", "checkpoint_dir", "load_parameters_path", "load_full_state_path"):
        path = getattr(c, key)
        if "://" not in path:
            continue
        if not path.startswith(STORAGE_SCHEMES):
            raise ConfigError(f"{key}={path}: run directories and checkpoints are local paths or gs:// only")
        if not path[len("gs://"):].split("/", 1)[0]:
            raise ConfigError(f"{key}={path}: a gs:// path needs a bucket name (gs://BUCKET/dir)")


def _validate_launch(c: Config) -> None:
    """The Ray launcher's keys (maxlite/launch/ray_trainer.py): checked for every recipe."""
    if c.ray_use_tpu and c.ray_use_gpu:
        raise ConfigError("set only one of ray_use_tpu and ray_use_gpu")
    if c.ray_num_workers == 0 or c.ray_num_workers < -1:
        raise ConfigError(f"ray_num_workers={c.ray_num_workers} must be at least 1 (or -1)")
    per_worker = (c.tpu_chips_per_host if c.ray_use_tpu else c.ray_gpus_per_worker if c.ray_use_gpu
                  else c.ray_simulated_devices_per_worker)
    if per_worker < 1:
        raise ConfigError("devices per worker (tpu_chips_per_host / ray_gpus_per_worker / "
                          "ray_simulated_devices_per_worker) must be at least 1")
    workers = c.ray_workers
    if c.ray_min_workers and c.ray_use_tpu:
        raise ConfigError("ray_min_workers: elastic groups of TPU hosts (whole slices) are not supported yet; "
                          "leave it 0 on TPU")
    if c.ray_min_workers > workers:
        raise ConfigError(f"ray_min_workers={c.ray_min_workers} is more than the {workers} workers")


def check_layout(c: Config, num_processes: int) -> None:
    """What the resolved mesh (`config.resolve`: every axis filled) needs of the recipe: whole
    sequences per batch shard, a sequence within one process or across whole processes, dimensions
    the tensor, fsdp × context and expert axes divide."""
    data, fsdp, context, expert, tensor = (c.axis_size(a) for a in MESH_AXES)
    shards = data * fsdp * expert
    batch_axes = "data×fsdp×expert" if expert > 1 else "data×fsdp"
    # MaxText's meaning: global batch = per_device_batch_size × devices. Each batch shard holds
    # per_device_batch_size × context × tensor whole sequences, so a fraction of a sequence per
    # device (0.25: one sequence over four chips) is whole exactly when the context axis splits it.
    rows = c.per_device_batch_size * context * tensor
    if abs(rows - round(rows)) > 1e-9 or round(rows) == 0:
        hint = "; change per_device_batch_size or the mesh"
        if c.per_device_batch_size < 1:
            split = 1 / c.per_device_batch_size
            example = f", e.g. ici_context_parallelism={round(split)}" if abs(split - round(split)) < 1e-9 else ""
            hint = (f"; a fraction of a sequence per device needs context parallelism to split it "
                    f"(per_device_batch_size × context × tensor whole){example}")
        raise ConfigError(
            f"per_device_batch_size={c.per_device_batch_size:g} × {c.num_devices} devices gives each of the "
            f"{batch_axes} = {shards} batch shards {rows:g} sequences, not a whole number{hint}")
    # Processes whose devices hold the same rows read the same rows (maxlite/mesh.py readers), so
    # the devices sharing a sequence must lie within one process or span whole processes; then
    # whole rows per batch shard (above) divide the global batch among the readers as well.
    per_process, share = c.num_devices // num_processes, context * tensor
    if per_process % share and share % per_process:
        raise ConfigError(f"context × tensor = {share} devices share a sequence but a process has {per_process}: "
                          f"they must lie within one process or span whole processes; change "
                          f"ici_context_parallelism or ici_tensor_parallelism")
    if share > per_process and c.train_objective != "lm":  # the alignment data assemble their own rows
        raise ConfigError(f"context × tensor = {share} devices share a sequence across processes (a process has "
                          f"{per_process}): only train_objective=lm reads rows that way; lower ici_tensor_parallelism")
    for key in ("base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "vocab_size"):
        if getattr(c, key) % tensor:
            raise ConfigError(f"{key}={getattr(c, key)} is not divisible by tensor parallelism {tensor}")
    if c.base_emb_dim % (fsdp * context):
        raise ConfigError(f"base_emb_dim={c.base_emb_dim} is not divisible by fsdp × context parallelism "
                          f"{fsdp} × {context} (the weights are sharded over both)")
    if expert > 1 and (c.num_experts % expert or not FAMILIES[c.decoder_block].moe):
        raise ConfigError(f"expert parallelism {expert} splits the experts: num_experts={c.num_experts} must be a "
                          f"multiple of it (a dense model has none; use ici_expert_parallelism=1)")
    if c.num_experts and c.base_moe_mlp_dim % tensor:
        raise ConfigError(f"base_moe_mlp_dim={c.base_moe_mlp_dim} is not divisible by tensor parallelism {tensor}")
    if context > 1 and expert > 1:
        raise ConfigError(f"context parallelism {context} with expert parallelism {expert} is not supported yet: "
                          f"the experts' token exchange takes whole sequences; use one of the two")
    if context > 1:
        _check_context(c, context)


def _check_context(c: Config, context: int) -> None:
    """What a sequence split over `context` shards needs (maxlite/models/context.py)."""
    if c.train_objective != "lm":
        raise ConfigError(f"context parallelism (context={context}) is for train_objective=lm (pre-training, "
                          f"SFT); set ici_context_parallelism=1 for train_objective={c.train_objective}")
    pieces = sequence_pieces(c)
    if c.max_target_length % pieces:
        why = " (load balance: two chunks per shard)" if c.context_parallel_load_balance else ""
        raise ConfigError(f"max_target_length={c.max_target_length} must be divisible by {pieces} to split "
                          f"over context={context}{why}")
    chunk = c.max_target_length // pieces
    if c.attention == "blockwise" and chunk % min(c.attention_block_size, chunk):
        raise ConfigError(f"attention_block_size={c.attention_block_size} must divide the {chunk}-token "
                          f"chunks of max_target_length={c.max_target_length} over context={context}")

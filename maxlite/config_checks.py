"""Every check of the recipe, in one place. What each value of a Config may be: choices, ranges,
and the checks across keys (the layers' kinds, each by the checks its entry in models/kinds.py
names; an alignment objective's data, the data source's keys, resilience, storage, launchers and
their elastic groups) that need no device count: `config.load` runs `validate` on every Config it
builds (an alignment objective's part lives in config_checks_alignment.py, which this module runs).
What the devices need once `config.resolve` has filled the mesh: `check_layout` and
`check_platform`, which resolve runs. And what only a caller knows: `check_platform` for a model made
off any mesh (maxlite.api), `check_keeper` for the loop.

Imports the schema and the recipe, never config.py (which imports this module)."""

from __future__ import annotations

from maxlite import quant
from maxlite.config_checks_alignment import check_objective, check_rollout_processes
from maxlite.models import lora_targets, names
from maxlite.models.families import FAMILIES
from maxlite.models.kinds import MIXERS, check_kinds
from maxlite.models.layout import check_layer_pattern, layer_kinds, layer_stacks
from maxlite.models.sides import sides
from maxlite.recipe import (FILE_DATASETS, Config, parse_max_time, parse_signals, parse_split,
                            topology_chips)
from maxlite.schema import FIELDS, MESH_AXES, ConfigError, keys_of

# Keys only some data sources read: set on a run whose source ignores them, they are refused (a
# setting that silently does nothing is a mistake the user should hear about).
SOURCE_KEYS = {
    "data_prefix": ("indexed",), "eval_data_prefix": ("indexed",), "data_split": ("indexed",),
    "grain_worker_count": ("indexed",), "grain_threads": ("indexed",), "data_cache_dir": ("indexed",),
    "dataset_path": FILE_DATASETS, "eval_dataset_path": FILE_DATASETS, "json_keys": ("text",),
    "add_eos": ("text",), "packing_bins": ("text", "sft"), "data_shuffle_window": FILE_DATASETS,
    "data_bad_record_policy": FILE_DATASETS, "sft_train_on_inputs": ("sft",),
    "sft_allow_degenerate_mask": ("sft",), "sft_audit_records": ("sft",), "sft_audit_examples": ("sft",),
    "bundled_prompts": ("prompts",),
}
STORAGE_SCHEMES = ("gs://",)  # besides local paths: what checkpoints and run directories support

# The choices that are name tables of the code (the schema, a leaf, declares the others: schema.key).
_TABLE_CHOICES = {
    "decoder_block": tuple(FAMILIES),
    "remat_policy": names.REMAT_POLICIES,
    "attention": names.ATTENTION,
    "moe_implementation": names.MOE_IMPLEMENTATIONS,
    "quantization": names.QUANTIZATION,
}


def validate(c: Config) -> None:
    """Checks that need no device count."""
    for key, f in FIELDS.items():
        _check_value(key, getattr(c, key), _TABLE_CHOICES.get(key, f.metadata["choices"]), f.metadata["bounds"],
                     f.metadata["positive"])
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
    if c.max_segments_per_seq < 0:
        raise ConfigError(f"max_segments_per_seq={c.max_segments_per_seq} must be >= 0 "
                          "(0 = cudnn_flash always takes the dense mask)")
    if c.attention == "blockwise" and c.max_target_length % min(c.attention_block_size,
                                                                c.max_target_length):
        raise ConfigError(f"attention_block_size={c.attention_block_size} must divide "
                          f"max_target_length={c.max_target_length}")
    if c.mlp_activations_limit and FAMILIES[c.decoder_block].mlp not in ("clamped_swiglu", "limited_swiglu"):
        raise ConfigError(f"mlp_activations_limit={c.mlp_activations_limit} clamps gpt-oss's and DeepSeek-V4's "
                          f"SwiGLU; decoder_block={c.decoder_block} has neither: leave it 0")
    _validate_kinds(c)
    _validate_vision(c)
    _validate_image_blocks(c)
    check_objective(c)
    _validate_data(c)
    _validate_resilience(c)
    _validate_storage(c)
    _validate_launch(c)
    if not 0 <= c.lora_dropout < 1:
        raise ConfigError(f"lora_dropout={c.lora_dropout} must be in [0, 1)")
    rotary = int(c.head_dim * c.partial_rotary_factor)
    if rotary < 2 or rotary % 2:
        raise ConfigError(f"partial_rotary_factor={c.partial_rotary_factor} rotates {rotary} of head_dim={c.head_dim} "
                          f"dimensions: RoPE needs an even number, at least 2")
    if c.local_rope_max_timescale and not c.sliding_window:
        raise ConfigError(f"local_rope_max_timescale={c.local_rope_max_timescale} is the RoPE base of "
                          f"sliding-window layers: set sliding_window too, or leave it 0")
    if c.lora_rank:
        if not FAMILIES[c.decoder_block].gated:
            raise ConfigError(f"lora_rank={c.lora_rank}: LoRA is available for gated-MLP families "
                              f"({', '.join(f.name for f in FAMILIES.values() if f.gated)}), not {c.decoder_block}")
        if c.lora_alpha <= 0 or not c.lora_targets:
            raise ConfigError("LoRA needs lora_alpha > 0 and at least one of lora_targets")
        targets = lora_targets.check(c)
        if targets:
            raise ConfigError(targets)
    for prefix in ("ici", "dcn"):
        values = c.parallelism(prefix)
        if values.count(-1) > 1:
            raise ConfigError(f"only one {prefix}_*_parallelism may be -1, got {values}")
        if any(v == 0 or v < -1 for v in values):
            raise ConfigError(f"{prefix}_*_parallelism must be positive or -1, got {values}")


def _check_value(key: str, value, choices: tuple, bounds: tuple | None, positive: bool) -> None:
    """One key's value against its choices (each item of a list), its inclusive bounds, or > 0."""
    for item in (value if isinstance(value, tuple) else (value,)) if choices else ():
        if item not in choices:
            listed = ", ".join(x or '""' for x in choices)
            raise ConfigError(f"{key}={item!r}: choose one of {listed}")
    if positive and value <= 0:
        raise ConfigError(f"{key}={value} must be positive")
    low, high = bounds or (None, None)
    if (low is not None and value < low) or (high is not None and value > high):
        where = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{key}={value} must be {where}")


def _validate_kinds(c: Config) -> None:
    """The layers' kinds: the pattern that gives each layer its kinds, then each kind's own checks
    (maxlite/models/kind_checks.py, named by its entry in maxlite/models/kinds.py)."""
    problem = check_layer_pattern(c) or check_kinds(c)
    if problem:
        raise ConfigError(problem)


def _validate_data(c: Config) -> None:
    """The data source's keys: each read by the chosen source (else refused), each well-formed."""
    for key, sources in SOURCE_KEYS.items():
        if c.dataset_type not in sources and getattr(c, key) != FIELDS[key].default:
            raise ConfigError(f"{key} is read by dataset_type={' or '.join(sources)}, but this run reads "
                              f"dataset_type={c.dataset_type}: remove {key} or change dataset_type")
    if c.dataset_type == "indexed":
        parse_split(c.data_split)
        if not c.data_prefix:
            raise ConfigError("dataset_type=indexed needs data_prefix=[w1,prefix1,...] "
                              "(make one with python -m maxlite.data.preprocess)")
    if c.dataset_path and c.bundled_prompts != FIELDS["bundled_prompts"].default:
        raise ConfigError(f"bundled_prompts={c.bundled_prompts} names a bundled set, read only when dataset_path "
                          f"is \"\": remove one of the two")
    if c.dataset_type in FILE_DATASETS and c.eval_interval > 0 and c.dataset_path and not c.eval_dataset_path:
        raise ConfigError(f"dataset_type={c.dataset_type} with your own dataset_path and eval_interval > 0: "
                          f"set eval_dataset_path for evaluation on your own data (or eval_interval=0)")
    for key in keys_of("paths"):
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
    if c.ray_use_tpu:
        _validate_tpu_hosts(c)
    workers = c.ray_workers
    if c.ray_min_workers and c.ray_use_tpu:
        raise ConfigError("ray_min_workers: elastic groups of TPU hosts (whole slices) are not supported yet; "
                          "leave it 0 on TPU")
    if c.ray_min_workers > workers:
        raise ConfigError(f"ray_min_workers={c.ray_min_workers} is more than the {workers} workers")
    for size in range(c.ray_min_workers, workers) if c.ray_min_workers else ():
        _check_group(c, size)


def _validate_tpu_hosts(c: Config) -> None:
    """A TPU slice's hosts (`Config.ray_workers`) from the topology the keys say."""
    if not c.tpu_topology or not c.tpu_accelerator_type:
        raise ConfigError("ray_use_tpu=true needs tpu_topology (e.g. 4x4) and "
                          "tpu_accelerator_type (e.g. TPU-V6E)")
    chips = topology_chips(c.tpu_topology)
    if chips % c.tpu_chips_per_host:
        raise ConfigError(f"tpu_topology={c.tpu_topology} has {chips} chips, not a multiple of "
                          f"tpu_chips_per_host={c.tpu_chips_per_host}")
    slices = c.num_slices if c.num_slices > 0 else 1
    hosts = chips // c.tpu_chips_per_host * slices
    if c.ray_num_workers not in (-1, hosts):
        raise ConfigError(
            f"ray_num_workers={c.ray_num_workers}, but {slices} slice(s) of {c.tpu_topology} "
            f"with {c.tpu_chips_per_host} chips per host have {hosts} hosts; set it to {hosts} or -1")


def _check_group(c: Config, workers: int) -> None:
    """An elastic Ray group of `workers` of the `ray_workers` hosts keeps the global batch: the lost
    share goes to gradient accumulation (maxlite.launch.ray_trainer.group_config), so the full
    group's micro-batches must divide among the `workers` left."""
    full = c.ray_workers
    if (c.gradient_accumulation_steps * full) % workers:
        raise ConfigError(
            f"ray_min_workers={c.ray_min_workers}: a group of {workers} of {full} workers cannot keep the "
            f"global batch (gradient_accumulation_steps={c.gradient_accumulation_steps} × {full} workers "
            f"is not a multiple of {workers}); raise ray_min_workers or pick sizes that divide it")


def check_keeper(c: Config, launcher_keeper: bool) -> None:
    """In-memory snapshots kept by Ray (`inmemory_snapshot_keeper=ray`) need the launcher that
    provides that keeper (`launcher_keeper`)."""
    if c.inmemory_snapshot_period > 0 and c.inmemory_snapshot_keeper == "ray" and not launcher_keeper:
        raise ConfigError("inmemory_snapshot_keeper=ray needs the Ray launcher (python -m ray_entry.train); "
                          "use shm or auto")


def check_platform(c: Config, platform: str) -> None:
    """What the devices' `platform` (cpu | gpu | cuda | rocm | tpu) cannot run: a quantization mode,
    cuDNN's attention in float32."""
    platform = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    if c.attention == "cudnn_flash" and c.dtype not in names.CUDNN_DTYPES:
        raise ConfigError(f"attention=cudnn_flash takes bfloat16 (cuDNN's fused attention), not "
                          f"dtype={c.dtype}: set dtype=bfloat16, or attention=dot_product (or autoselected)")
    if c.quantization and c.quantization not in quant.modes_for(platform):
        others = ", ".join(quant.modes_for(platform))
        raise ConfigError(f"quantization={c.quantization} runs on GPUs only (one scale per tensor for cuBLASLt's "
                          f"FP8 GEMMs); on {platform} use one of {others}")


def check_layout(c: Config, num_processes: int) -> None:
    """What the resolved mesh (`config.resolve`: every axis filled) needs of the recipe: whole
    sequences per batch shard, a sequence within one process or across whole processes, dimensions
    the tensor, fsdp × context and expert axes divide."""
    data, stage, fsdp, context, expert, tensor = (c.axis_size(a) for a in MESH_AXES)
    shards = data * fsdp * expert
    batch_axes = "data×fsdp×expert" if expert > 1 else "data×fsdp"
    # MaxText's meaning: global batch = per_device_batch_size × devices. Each batch shard holds
    # per_device_batch_size × stage × context × tensor whole sequences, so a fraction of a sequence per
    # device (0.25: one sequence over four chips) is whole exactly when the context axis splits it.
    rows = c.per_device_batch_size * stage * context * tensor
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
    check_rollout_processes(c, num_processes)
    for key in ("base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "vocab_size"):
        if getattr(c, key) % tensor:
            raise ConfigError(f"{key}={getattr(c, key)} is not divisible by tensor parallelism {tensor}")
    if c.base_emb_dim % (fsdp * context):
        raise ConfigError(f"base_emb_dim={c.base_emb_dim} is not divisible by fsdp × context parallelism "
                          f"{fsdp} × {context} (the weights are sharded over both)")
    kinds = check_kinds(c, layout=True)  # the experts' axis, a recurrence across context shards
    if kinds:
        raise ConfigError(kinds)
    if context > 1:
        _check_context(c, context)
    if stage > 1:
        _check_pipeline(c, stage, round(rows))


def _validate_vision(c: Config) -> None:
    """An encoder kind's shape keys set (names.VISION_KEYS): 0 would build no tower, or a tower no
    image fits."""
    unset = [k for k in names.VISION_KEYS.get(c.vision_encoder, ()) if not getattr(c, k)]
    if unset:
        raise ConfigError(f"vision_encoder={c.vision_encoder} needs {', '.join(unset)} (an imported recipe.yml "
                          f"states them)")


def _validate_image_blocks(c: Config) -> None:
    """A vision encoder whose image tokens attend both ways (names.image_blocks: Gemma 3's siglip,
    Gemma 4's gemma4_vit with vision_bidirectional) needs an attention that draws those blocks, on
    grouped-query attention layers (Gemma 4's own), whole sequences per device (_check_context)."""
    if c.vision_bidirectional and c.vision_encoder != "gemma4_vit":
        raise ConfigError(f"vision_bidirectional=true is Gemma 4's (vision_encoder=gemma4_vit), not "
                          f"vision_encoder={c.vision_encoder or 'empty'}'s")
    if c.vision_encoder == "gemma4_vit" and c.per_layer_embed_dim and c.pad_token_id < 0:
        raise ConfigError("vision_encoder=gemma4_vit with per-layer embeddings: set pad_token_id (an image token "
                          "takes its per-layer embedding; Gemma 4's is 0)")
    if not names.image_blocks(c):
        return
    if c.attention not in ("autoselected", *names.IMAGE_BLOCK_ATTENTION):
        raise ConfigError(f"attention={c.attention} cannot draw vision_encoder={c.vision_encoder}'s bidirectional "
                          f"image blocks: use attention=dot_product or blockwise (or autoselected)")
    others = sorted({k.mixer for k in layer_kinds(c) if not MIXERS[k.mixer].image_blocks})
    if others:
        raise ConfigError(f"vision_encoder={c.vision_encoder}'s bidirectional image blocks are drawn by the attention "
                          f"mixers only (attention, Gemma 4's), not {', '.join(others)}")


def _check_pipeline(c: Config, stages: int, rows: int) -> None:
    """What `stages` pipeline stages need (maxlite/models/pipeline.py): one scanned stack of layers
    that splits into stages × repeats, at least as many micro-batches as stages, and each batch
    shard's `rows` splitting into them; stages pass the hidden states only, none of the sides that
    travel with them in the layers' carry (checked first: the layout of such a model is moot)."""
    travelling = [side.title for side in sides(c) if side.travels]
    if travelling:
        raise ConfigError(f"pipeline parallelism passes only the hidden states between stages, not "
                          f"{' or '.join(travelling)}: set ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1")
    if c.hc_mult:
        raise ConfigError(f"pipeline parallelism passes one residual between stages, not hyper-connections' "
                          f"hc_mult={c.hc_mult} streams: set ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1")
    stacks = layer_stacks(c)
    if not c.scan_layers or len(stacks) != 1:
        fix = ("set scan_layers=true" if not c.scan_layers else "set first_num_dense_layers=0"
               if stacks[0].name == "dense_layers" else
               f"this model's layers are stored as {' + '.join(s.name for s in stacks)} (maxlite/models/layout.py)")
        raise ConfigError(f"pipeline parallelism ({stages} stages) runs one scanned stack of layers: {fix}")
    units, unit = stacks[0].count, len(stacks[0].unit)
    repeats, per_stage = c.pipeline_repeats, c.num_layers_per_pipeline_stage
    if units % (stages * repeats) or (per_stage > 0 and per_stage * stages * repeats != c.base_num_decoder_layers):
        raise ConfigError(f"base_num_decoder_layers={c.base_num_decoder_layers} does not split into {stages} pipeline "
                          f"stages × {repeats} repeats" + (f" × {per_stage} layers per stage" if per_stage > 0 else "")
                          + (f" of whole {unit}-layer blocks" if unit > 1 else "")
                          + "; change num_pipeline_repeats, num_layers_per_pipeline_stage or the pipeline axis")
    micro = c.pipeline_microbatches
    if micro < stages:
        raise ConfigError(f"num_pipeline_microbatches={micro} is fewer than the {stages} pipeline stages; "
                          f"use at least {stages}")
    if rows % micro:
        raise ConfigError(f"each batch shard's {rows} sequences per micro-batch do not split into "
                          f"num_pipeline_microbatches={micro}; change per_device_batch_size or the micro-batches")
    if c.lora_rank and c.lora_dropout > 0:
        raise ConfigError("lora_dropout > 0 is not supported with pipeline parallelism yet; set lora_dropout=0")


def _check_context(c: Config, context: int) -> None:
    """What a sequence split over `context` shards needs (maxlite/models/context.py; a kind's own
    needs are its layout checks)."""
    if names.image_blocks(c):
        raise ConfigError(f"vision_encoder={c.vision_encoder}'s bidirectional image blocks are not drawn across "
                          f"context shards: set ici_context_parallelism=1 and dcn_context_parallelism=1")
    if c.vision_encoder:  # the load-balanced layout reorders a row's arrays, its image patches with its tokens
        raise ConfigError(f"vision_encoder={c.vision_encoder}: a row's images are not split over context shards; "
                          f"set ici_context_parallelism=1 and dcn_context_parallelism=1")
    if c.train_objective != "lm":
        raise ConfigError(f"context parallelism (context={context}) is for train_objective=lm (pre-training, "
                          f"SFT); set ici_context_parallelism=1 for train_objective={c.train_objective}")
    if c.mtp_num_layers and c.context_parallel_load_balance:
        raise ConfigError("mtp_num_layers > 0 reads tokens ahead in sequence order, which context parallelism's "
                          "load balance reorders: set context_parallel_load_balance=false")
    pieces = c.sequence_pieces
    if c.max_target_length % pieces:
        why = " (load balance: two chunks per shard)" if c.context_parallel_load_balance else ""
        raise ConfigError(f"max_target_length={c.max_target_length} must be divisible by {pieces} to split "
                          f"over context={context}{why}")
    chunk = c.max_target_length // pieces
    if c.attention == "blockwise" and chunk % min(c.attention_block_size, chunk):
        raise ConfigError(f"attention_block_size={c.attention_block_size} must divide the {chunk}-token "
                          f"chunks of max_target_length={c.max_target_length} over context={context}")

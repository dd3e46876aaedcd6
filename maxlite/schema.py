"""The recipe's schema: every key, its type, its default, the values it may take and the one line
of doc base.yml shows.

This is the one place a key is declared (with the two modules named below). `Keys` is the frozen,
statically typed dataclass of them all (`maxlite.recipe.Config`, what `maxlite.config.load` builds,
adds what follows from them); `configs/base.yml` is written from it (maxlite/base_yml.py: `python -m
maxlite.base_yml`) and tests/test_schema.py fails when the two differ. Adding a key: one `name: type = key(default, "doc", ...)` line in its section
below (with `choices=`, `bounds=` or `positive=` when its values are limited; `kind=` when it names
files), then `python -m maxlite.base_yml` to rewrite base.yml.

The model's sections live in schema_model.py and the alignment ones in schema_alignment.py (each a
dataclass `Keys` inherits, in base.yml's order); `key` in schema_key.py. A leaf with them: no JAX and
nothing else of maxlite, so that loading (config.py), the derived values (recipe.py) and the checks
(config_checks.py) all import it and none imports another back.
"""

# No `from __future__ import annotations` here: loading reads each field's type as a type (Field.type).
import dataclasses
import pathlib

from maxlite.schema_alignment import AlignmentKeys
from maxlite.schema_key import KINDS, key  # noqa: F401 (KINDS: config.py's kinds of value)
from maxlite.schema_model import ModelKeys

BASE_YML = pathlib.Path(__file__).parent / "configs" / "base.yml"
MESH_AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")  # order of the device mesh axes


def parallelism_key(prefix: str, axis: str) -> str:
    """The recipe key of a mesh axis's size: `{ici|dcn}_{axis}_parallelism`; the `stage` axis's keys
    keep MaxText's name, `{ici|dcn}_pipeline_parallelism`."""
    return f"{prefix}_{'pipeline' if axis == 'stage' else axis}_parallelism"


class ConfigError(ValueError):
    """A user mistake in the recipe: printed as one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class _RunKeys:
    """The run and its loggers."""

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


@dataclasses.dataclass(frozen=True)
class _TrainingKeys:
    """Performance, batch and sequence, optimizer, mesh, data, checkpoints, launch and resilience."""

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
        "layers: one more forward; with offload_layer_inputs that input goes to host memory); false: each "
        "iteration keeps its layers' inputs")
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
    max_images_per_row: int = key(4, "vision SFT (siglip, gemma4_vit): images a packed row holds (its documents' "
        "together; siglip: each vision_image_size square, gemma4_vit: each up to vision_tokens_per_image × "
        "vision_pool_size² patches); a conversation with more is reported and skipped", positive=True)
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


@dataclasses.dataclass(frozen=True)
class _AdapterSamplingFaultKeys:
    """LoRA, sampling and fault injection."""

    lora_rank: int = key(0,
        "adapter rank r; 0 = off (full fine-tuning)",
        section="LoRA: low-rank adapters, base weights frozen (docs/lora.md)", bounds=(0, None))
    lora_alpha: float = key(16.0, "the update is (lora_alpha / lora_rank) · x A B")
    lora_dropout: float = key(0.0, "dropout on the adapters' input while training (PEFT's), in [0, 1)")
    lora_targets: tuple[str, ...] = key(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "HF / PEFT module names (latent attention's, the delta-net's and DeepSeek-V4's own: docs/lora.md)",
        choices=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                 "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj", "kv_proj", "o_b_proj"))

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


@dataclasses.dataclass(frozen=True)
class Keys(_AdapterSamplingFaultKeys, AlignmentKeys, _TrainingKeys, ModelKeys, _RunKeys):
    """Every key of the recipe, typed; frozen. Lists are tuples. A dataclass takes its bases' fields
    from the last base to the first: run, model, training, alignment, then LoRA, sampling and faults:
    base.yml's order."""


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

"""`Config`: the schema's keys (maxlite/schema.py) and the values that follow from them (the mesh,
the batch, the schedule, the Ray workers), and the parsers of the keys whose text has a format of
its own (data blends, splits, wall-clock budgets, signals, TPU topologies, paths).

No JAX, nothing of maxlite above the schema: loading (config.py) and checking (config_checks.py)
both import it. The derived values assume a checked recipe (`config.load` runs the checks), and the
mesh's are concrete after `config.resolve`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
from typing import Any

import yaml

from maxlite.schema import MESH_AXES, ConfigError, Keys, parallelism_key

OBJECTIVE_DATASET = {"dpo": "preference", "grpo": "prompts"}  # the dataset_type an alignment objective reads
CHAT_DATASETS = ("sft", "preference", "prompts")  # rendered with the chat template (sft_template)
FILE_DATASETS = ("text", *CHAT_DATASETS)  # read from dataset_path / eval_dataset_path files
# Each loss_algo's own values of the RL loss keys left at their "follow the algorithm" setting
# (docs/alignment.md has the table): (loss_agg_mode, grpo_beta, epsilon_high; None: grpo_epsilon).
# DAPO's ε_high 0.28 and β 0 are the paper's (Yu et al. 2025, §3.1 and its recipe); the rest keep
# today's GRPO (TRL's token mean, β 0.04, symmetric clipping); GSPO and Dr. GRPO average as their
# papers write the objective.
RL_LOSS_DEFAULTS = {
    "grpo": ("token-mean", 0.04, None),
    "gspo-token": ("sequence-mean-token-mean", 0.04, None),
    "dapo": ("token-mean", 0.0, 0.28),
    "dr_grpo": ("sequence-sum", 0.04, None),
}


@dataclasses.dataclass(frozen=True)
class Config(Keys):
    """The recipe: every key of the schema, typed and frozen, and what follows from them."""

    def parallelism(self, prefix: str) -> tuple[int, ...]:
        return tuple(getattr(self, parallelism_key(prefix, axis)) for axis in MESH_AXES)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Global mesh shape over MESH_AXES: ici × dcn per axis."""
        return tuple(i * d for i, d in zip(self.parallelism("ici"), self.parallelism("dcn")))

    def axis_size(self, axis: str) -> int:
        """The global size of one mesh axis (MESH_AXES)."""
        return self.mesh_shape[MESH_AXES.index(axis)]

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def sequence_pieces(self) -> int:
        """The contiguous chunks a sequence is cut into across the context axis: one per shard, or two
        with context_parallel_load_balance (chunks i and 2n−1−i on shard i: maxlite/models/context.py)."""
        context = self.axis_size("context")
        return 2 * context if context > 1 and self.context_parallel_load_balance else context

    @property
    def pipeline_repeats(self) -> int:
        """R: times the micro-batches go round the stages (num_pipeline_repeats, or what
        num_layers_per_pipeline_stage implies; 1 without a pipeline)."""
        stages = self.axis_size("stage")
        if self.num_pipeline_repeats > 0 or stages == 1:
            return max(self.num_pipeline_repeats, 1)
        if self.num_layers_per_pipeline_stage > 0:
            return self.base_num_decoder_layers // (stages * self.num_layers_per_pipeline_stage)
        return 1

    @property
    def pipeline_microbatches(self) -> int:
        """M: micro-batches per pipeline pass (num_pipeline_microbatches; -1: the stages)."""
        return self.axis_size("stage") if self.num_pipeline_microbatches == -1 else self.num_pipeline_microbatches

    @property
    def pipeline_bubble(self) -> float:
        """The idle fraction of the pipeline's schedule: (P − 1) / (R·M + P − 1)."""
        stages = self.axis_size("stage")
        return (stages - 1) / (self.pipeline_repeats * self.pipeline_microbatches + stages - 1)

    @property
    def pipeline_schedule(self) -> dict[str, Any] | None:
        """The pipeline as a run reports it (status.json, the summary, the planner); None without one."""
        stages = self.axis_size("stage")
        if stages == 1:
            return None
        repeats = self.pipeline_repeats
        return {"schedule": "circular" if repeats > 1 else "gpipe", "stages": stages, "repeats": repeats,
                "microbatches": self.pipeline_microbatches,
                "layers_per_stage": self.base_num_decoder_layers // (stages * repeats),
                "bubble_fraction": self.pipeline_bubble}

    @property
    def micro_batch_size(self) -> int:
        """Global sequences per micro-batch."""
        return round(self.per_device_batch_size * self.num_devices)

    @property
    def global_batch_size(self) -> int:
        """Global sequences per optimizer step."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.max_target_length

    @property
    def schedule_steps(self) -> int:
        """The learning-rate schedule's length: learning_rate_schedule_steps, or `steps` (-1)."""
        return self.steps if self.learning_rate_schedule_steps == -1 else self.learning_rate_schedule_steps

    @property
    def warmup_steps(self) -> int:
        if self.lr_warmup_steps >= 0:
            return self.lr_warmup_steps
        return int(self.warmup_steps_fraction * self.schedule_steps)

    @property
    def first_moment_dtype(self) -> str:
        """The optimizer's first moment's dtype: mu_dtype, or weight_dtype when it is "" (MaxText's rule)."""
        return self.mu_dtype or self.weight_dtype

    @property
    def wsd_decay_steps(self) -> int:
        """lr_schedule_type=wsd: the decay's length, at the schedule's end."""
        return int(self.wsd_decay_steps_fraction * self.schedule_steps)

    @property
    def rl_loss_agg_mode(self) -> str:
        """loss_agg_mode, or the loss_algo's own ("")."""
        return self.loss_agg_mode or RL_LOSS_DEFAULTS[self.loss_algo][0]

    @property
    def rl_beta(self) -> float:
        """grpo_beta, or the loss_algo's own (-1)."""
        return RL_LOSS_DEFAULTS[self.loss_algo][1] if self.grpo_beta == -1 else self.grpo_beta

    @property
    def rl_epsilon_high(self) -> float:
        """epsilon_high, or the loss_algo's own (-1): DAPO's clip-higher, else grpo_epsilon (symmetric)."""
        if self.epsilon_high != -1:
            return self.epsilon_high
        own = RL_LOSS_DEFAULTS[self.loss_algo][2]
        return self.grpo_epsilon if own is None else own

    @property
    def run_dir(self) -> str:
        return f"{self.base_output_directory.rstrip('/')}/{self.run_name}"

    @property
    def ray_workers(self) -> int:
        """Ray Train workers = hosts. TPU: hosts per slice (topology chips / chips per host) × slices;
        else ray_num_workers (-1: 2). The checks (config_checks) made sure the keys say it."""
        if not self.ray_use_tpu:
            return 2 if self.ray_num_workers == -1 else self.ray_num_workers
        slices = self.num_slices if self.num_slices > 0 else 1
        return topology_chips(self.tpu_topology) // self.tpu_chips_per_host * slices

    def blend(self, key: str = "data_prefix") -> list[tuple[float, str]]:
        """(weight, prefix) pairs of a blend key, the weights summing to 1 ([] when unset)."""
        pairs = list(zip(getattr(self, key)[::2], getattr(self, key)[1::2]))
        total = sum(w for w, _ in pairs)
        return [(w / total, p) for w, p in pairs]

    @property
    def split_fractions(self) -> tuple[float, float, float]:
        """data_split as (train, valid, test) fractions."""
        return parse_split(self.data_split)

    @property
    def max_time_seconds(self) -> float | None:
        return parse_max_time(self.max_time)

    @property
    def preemption_signal_numbers(self) -> list[signal.Signals]:
        return parse_signals(self.preemption_signals)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- the keys whose text has a format of its own ----

def resolve_path(path: str) -> str:
    """A user's path as maxlite uses it: URLs (gs://...) as given; local paths absolute, `~` expanded.

    Every CLI path argument and Python API entry point goes through this as well."""
    path = str(path).strip()
    if not path or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def parse_blend(spec: Any, key: str = "data_prefix") -> tuple:
    """THE parse of a Megatron data blend — `prefix`, `[prefix, ...]` (equal weights) or
    `[w1, prefix1, w2, prefix2, ...]`, as YAML or as command-line text — into the typed value the
    config holds: (w1, prefix1, w2, prefix2, ...) with float weights and resolved paths."""
    items = spec
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("["):
            try:
                items = yaml.safe_load(text)
            except yaml.YAMLError:
                raise ConfigError(f"{key}={spec!r}: cannot parse; use [w1,prefix1,w2,prefix2]") from None
        else:
            items = text.replace(",", " ").split()
    if not isinstance(items, (list, tuple)):
        items = [items]
    items = [x for x in items if str(x).strip()]
    if not items:
        return ()

    def weight(x) -> float | None:
        if isinstance(x, bool):
            return None
        try:
            return float(x)
        except (TypeError, ValueError):
            return None

    if weight(items[0]) is None:  # prefixes only
        pairs = [(1.0, str(p)) for p in items]
    else:
        if len(items) % 2:
            raise ConfigError(f"{key}: expected weight,prefix pairs, got {len(items)} items")
        pairs = [(weight(w), str(p)) for w, p in zip(items[::2], items[1::2])]
        if any(w is None or w <= 0 for w, _ in pairs):
            raise ConfigError(f"{key}: weights must be positive numbers, got {list(items[::2])}")
    return tuple(x for w, p in pairs for x in (w, resolve_path(p)))


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's data_split '99,1,0' (also '99/1/0'; missing shares are 0) → fractions."""
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"data_split={split!r}: expected three numbers like 99,1,0") from None
    if len(parts) > 3:
        raise ConfigError(f"data_split={split!r}: expected at most three numbers (train,valid,test)")
    parts = (parts + [0.0] * 3)[:3]
    if any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"data_split={split!r}: shares must be non-negative with a positive sum")
    return tuple(p / sum(parts) for p in parts)


def parse_max_time(text: str) -> float | None:
    """max_time `D:HH:MM:SS` (also `HH:MM:SS`, `MM:SS`, `SS`) → seconds; "" → None."""
    text = text.strip()
    if not text:
        return None
    if not re.fullmatch(r"\d+(:\d+){0,3}", text):
        raise ConfigError(f"max_time={text!r}: expected D:HH:MM:SS, e.g. max_time=0:03:50:00")
    seconds = 0
    for value, unit in zip(reversed([int(p) for p in text.split(":")]), (1, 60, 3600, 86400)):
        seconds += value * unit
    if seconds <= 0:
        raise ConfigError(f"max_time={text!r} must be positive (or \"\" for no limit)")
    return float(seconds)


def parse_signals(text: str) -> list[signal.Signals]:
    """preemption_signals `SIGTERM,SIGUSR1` → signals (SIGINT is always the user's stop)."""
    out = []
    for name in filter(None, (s.strip().upper() for s in text.split(","))):
        name = name if name.startswith("SIG") else f"SIG{name}"
        if not hasattr(signal.Signals, name) or name in ("SIGKILL", "SIGSTOP", "SIGINT"):
            raise ConfigError(f"preemption_signals: {name} is not a catchable preemption signal (e.g. "
                              f"SIGTERM,SIGUSR1; SIGINT, Ctrl-C, always stops the run)")
        out.append(signal.Signals[name])
    return out


def topology_chips(topology: str) -> int:
    """tpu_topology `4x4` (or `2x2x4`) → its chips."""
    try:
        return math.prod(int(d) for d in topology.lower().split("x"))
    except ValueError:
        raise ConfigError(f"tpu_topology={topology!r}: write it as AxB or AxBxC, e.g. 4x4") from None

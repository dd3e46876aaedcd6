"""The post-training part of the recipe's checks (config_checks.py runs them, as schema_alignment.py is
the post-training part of the schema): an alignment objective's data and keys, GRPO's rewards, tools,
rollout engine and placement, and which of its rollouts run in one process only.

Imports the schema and the recipe, never config.py."""

from __future__ import annotations

import re

from maxlite.models.layout import layer_kinds
from maxlite.models.paged_kinds import refusal as paged_refusal
from maxlite.recipe import OBJECTIVE_DATASET, Config
from maxlite.rollout.engine import refusal
from maxlite.schema import FIELDS, ConfigError

def check_objective(c: Config) -> None:
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
    _validate_tools(c)
    if c.train_objective != "grpo":
        placement = [k for k in ("trainer_devices_fraction", "sampler_devices_fraction", "rollout_data_parallelism",
                                 "rollout_tensor_parallelism", "off_policy_steps", "rollout_workers",
                                 "rollout_worker_cpus", "rollout_worker_gpus") if getattr(c, k) != FIELDS[k].default]
        if placement:
            raise ConfigError(f"{placement[0]} places GRPO's rollouts: it is for train_objective=grpo")
        return
    if not c.reward_functions:
        raise ConfigError("train_objective=grpo needs reward_functions, e.g. [maxlite.objectives.rewards:exact_answer]")
    _function_names("reward_functions", c.reward_functions)
    if c.reward_weights and len(c.reward_weights) != len(c.reward_functions):
        raise ConfigError(f"reward_weights has {len(c.reward_weights)} values for "
                          f"{len(c.reward_functions)} reward_functions")
    if c.grpo_max_new_tokens >= c.max_target_length:
        raise ConfigError(f"grpo_max_new_tokens={c.grpo_max_new_tokens} leaves no room for the prompt in "
                          f"max_target_length={c.max_target_length}")
    if c.grpo_num_generations < 2:
        raise ConfigError("grpo_num_generations must be at least 2 (advantages are relative to the group)")
    shared = colocated(c)
    if c.off_policy_steps and shared and not c.rollout_workers:
        raise ConfigError(f"off_policy_steps={c.off_policy_steps} samples while the trainer trains: give the sampler "
                          "devices of its own (trainer_devices_fraction + sampler_devices_fraction ≤ 1) or "
                          "rollout_workers ≥ 1")
    if c.rollout_workers and not shared:
        raise ConfigError(f"rollout_workers={c.rollout_workers} generates in Ray actors of its own: leave "
                          "trainer_devices_fraction and sampler_devices_fraction at 1 (the trainer keeps every device)")
    if c.dynamic_sampling_max_batches > 1 and not c.dynamic_sampling:
        raise ConfigError(f"dynamic_sampling_max_batches={c.dynamic_sampling_max_batches} refills the groups "
                          "dynamic_sampling drops: set dynamic_sampling=true, or dynamic_sampling_max_batches=1")
    for key in ("grpo_beta", "epsilon_high"):
        if -1 < getattr(c, key) < 0:
            raise ConfigError(f"{key}={getattr(c, key)}: give a value ≥ 0, or -1 for the loss_algo's own")
    if c.eval_pass_k == 1:
        raise ConfigError("eval_pass_k=1: eval always reports the greedy pass_at_1; the sampled pass@k needs k >= 2 "
                          "(0: off)")
    if c.eval_pass_k > c.grpo_num_generations:
        raise ConfigError(f"eval_pass_k={c.eval_pass_k} needs at least that many samples per prompt: raise "
                          f"grpo_num_generations (now {c.grpo_num_generations}) or lower eval_pass_k")
    if (why := refusal(c.rollout_engine)) is not None:
        raise ConfigError(why)
    if c.rollout_paged_kv and (why := paged_refusal({k.mixer for k in layer_kinds(c)})) is not None:
        raise ConfigError(why)


def _function_names(key: str, names) -> list[str]:
    """The function names of `key`'s "package.module:function" entries, or the one line saying which is not one."""
    out = []
    for name in names:
        module, _, attr = str(name).partition(":")
        if not re.fullmatch(r"[A-Za-z_][\w.]*", module) or not attr.isidentifier():
            raise ConfigError(f"{key}: {name!r} is not 'package.module:function'")
        out.append(attr)
    return out


TOOL_KEYS = ("max_tool_turns", "tool_call_start", "tool_call_end", "tool_response_format", "tool_timeout_seconds",
             "tool_workers")


def _validate_tools(c: Config) -> None:
    """rollout_tools (maxlite/rollout/tools.py): the names' spelling and the room later turns need; the
    tokenizer's side (tool_call_end one token) and the loading are checked when the rollout is built."""
    if not c.rollout_tools:
        if given := [k for k in TOOL_KEYS if getattr(c, k) != FIELDS[k].default]:
            raise ConfigError(f"{given[0]} is read only with rollout_tools: name the tools, or remove {given[0]}")
        return
    if c.train_objective != "grpo":
        raise ConfigError("rollout_tools is for train_objective=grpo (its rollouts call the tools)")
    names = _function_names("rollout_tools", c.rollout_tools)
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"rollout_tools: two tools are called {twice!r} (a tool is called by its function's name)")
    if not c.tool_call_start or not c.tool_call_end or "{answer}" not in c.tool_response_format:
        raise ConfigError("rollout_tools needs a tool_call_start, a tool_call_end and a tool_response_format "
                          "holding {answer}")
    if c.max_target_length + c.grpo_max_new_tokens > c.max_position_embeddings:
        raise ConfigError(f"rollout_tools: a later turn continues a context of up to max_target_length="
                          f"{c.max_target_length} tokens by up to grpo_max_new_tokens={c.grpo_max_new_tokens}, "
                          f"past max_position_embeddings={c.max_position_embeddings}: lower one of the two")
    if c.max_num_batched_tokens < c.max_target_length:
        raise ConfigError(f"rollout_tools: a later turn prefills a whole context (up to max_target_length="
                          f"{c.max_target_length} tokens): raise max_num_batched_tokens={c.max_num_batched_tokens}")


def colocated(c: Config) -> bool:
    """GRPO's rollouts share the trainer's devices (both fractions 1; maxlite/rollout/reshard.py splits them
    otherwise)."""
    return (c.trainer_devices_fraction, c.sampler_devices_fraction) == (1.0, 1.0)


def check_rollout_processes(c: Config, num_processes: int) -> None:
    """GRPO's rollouts that run in one process for now (maxlite/rollout/): refused with the process count
    known, before any cluster starts (`ray_entry.train` resolves the recipe for its workers first)."""
    if c.train_objective != "grpo" or num_processes == 1:
        return
    how = "use one process (under Ray: ray_num_workers=1)"
    if c.off_policy_steps or c.rollout_workers or not colocated(c):
        raise ConfigError(f"separate rollout placement, rollout_workers and off_policy_steps run in one process for "
                          f"now (this run has {num_processes}): {how}, or the colocated default")
    if c.rollout_tools:  # several processes sample with the static sampler, which has no tool turns
        raise ConfigError(f"rollout_tools runs on the rollout engine, which samples in one process (this run has "
                          f"{num_processes}; several sample with the static sampler): {how}, or no rollout_tools")

"""The alignment keys of the recipe: DPO and GRPO after SFT, and RL's losses, rollout engine,
tools, placement and rewards (docs/alignment.md, docs/rl.md). Part of the schema
(maxlite/schema.py, whose `Keys` holds these among the others, in this order); a leaf."""

# No `from __future__ import annotations` here: loading reads each field's type as a type (Field.type).
import dataclasses

from maxlite.schema_key import key


@dataclasses.dataclass(frozen=True)
class AlignmentKeys:
    """The alignment sections of `Keys`."""

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

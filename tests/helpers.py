"""What tests share: a small in-process training driver (the library pieces the loop wires, on a
device subset), real `python -m` processes (one or several, jax.distributed over gloo), small
configs, a free port, polling with a deadline, and the matmuls of a jaxpr."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Callable, TypeVar

import jax
import jax.extend
import numpy as np
from flax import nnx

from maxlite import build as build_lib, config as C, mesh as mesh_lib, resume, state as state_lib
from maxlite.data.synthetic import make_synthetic_iterator
from tests.xla_flags import CHEAP_TRACE_ENV, cpu_xla_flags

# A very small llama: compiles fast on 2 busy cores.
SMALL = ["base.yml", "model_name=tiny", "base_emb_dim=64", "base_mlp_dim=128", "base_num_query_heads=2",
         "base_num_kv_heads=2", "head_dim=32", "base_num_decoder_layers=2", "vocab_size=256",
         "max_target_length=16", "per_device_batch_size=1", "enable_tensorboard=false", "write_report=false"]
# GRPO on SMALL with the bundled tokenizer's vocabulary, its rollouts on devices of their own (a
# quarter each): tests/test_rollout_async.py's runs, and the colocated base of test_rollout_actors.py's
GRPO_SEPARATE = [*SMALL, "vocab_size=4096", "dtype=float32", "train_objective=grpo", "dataset_type=prompts",
                 "max_target_length=52",
                 "reward_functions=[maxlite.objectives.rewards:exact_answer, maxlite.objectives.rewards:brevity]",
                 "grpo_max_new_tokens=6", "grpo_num_generations=4", "per_device_batch_size=1", "learning_rate=1e-2",
                 "lr_schedule_type=constant", "warmup_steps_fraction=0", "grpo_temperature=1.5", "log_period=1",
                 "eval_interval=0", "trainer_devices_fraction=0.25", "sampler_devices_fraction=0.25"]

# A very small mixture of experts (8 experts, top 2) in float32: what expert-parallel tests train.
MOE = ["base.yml", "model_name=tiny-moe", "base_emb_dim=32", "base_moe_mlp_dim=16", "base_mlp_dim=32",
       "base_num_query_heads=2", "base_num_kv_heads=2", "head_dim=16", "base_num_decoder_layers=2",
       "vocab_size=128", "max_target_length=16", "num_experts=8", "num_experts_per_tok=2", "dtype=float32",
       "enable_tensorboard=false", "write_report=false", "learning_rate=1e-2", "load_balance_loss_weight=0.1"]


def dot_equations(jaxpr):
    """Every dot_general equation of a jaxpr, those of its sub-jaxprs (scan, remat, jit) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from dot_equations(sub)


def build(argv, num_devices: int):
    """(cfg, mesh, a fresh state, the jitted step, batch sharding) on the first `num_devices` devices."""
    built = build_lib.build(C.load(argv), jax.devices()[:num_devices], num_processes=1)
    return built.cfg, built.mesh, built.init_state(), built.train_step, built.batch_sharding


def train_losses(argv, num_devices: int, steps: int):
    """Losses of `steps` steps, and the final state (on host)."""
    cfg, mesh, state, step, batch_sharding = build(argv, num_devices)
    data = make_synthetic_iterator(cfg, "train", 0, 1)
    losses = []
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for _ in range(steps):
            batch = {k: jax.device_put(v, batch_sharding) for k, v in next(data).items()}
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state)


def trained(tmp_path, extra=(), steps=2, devices=8, mesh=("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")):
    """A SMALL state trained a few steps (fsdp=4 × tensor=2 by default), its config and data iterator."""
    argv = [*SMALL, *mesh, f"base_output_directory={tmp_path}/runs", "run_name=src", *extra]
    cfg, _, state, step, sharding = build(argv, devices)
    data = make_synthetic_iterator(cfg, "train", 0, 1)
    for _ in range(steps):
        state, _ = step(state, {k: jax.device_put(v, sharding) for k, v in next(data).items()})
    return cfg, state, data


def start(tmp_path, argv, devices, ckpt=True):
    """What train() does up to the first step: (cfg, where the run starts — maxlite.resume.Start:
    its state, step and source —, data, checkpointer)."""
    built, started, data, checkpointer = start_built(tmp_path, argv, devices, ckpt)
    return built.cfg, started, data, checkpointer


def start_built(tmp_path, argv, devices, ckpt=True):
    """`start`, with the maxlite.build.Built it wired (its train_step continues the run)."""
    from maxlite.checkpoints.saver import Checkpointer

    built = build_lib.build(C.load([*SMALL, f"base_output_directory={tmp_path}/runs", *argv]),
                            jax.devices()[:devices], num_processes=1)
    checkpointer = Checkpointer(built.cfg, True, state_lib.nbytes(built.abstract)) if ckpt else None
    data = make_synthetic_iterator(built.cfg, "train", 0, 1)
    return built, resume.decide(built, checkpointer, data, 0, True), data, checkpointer


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def process_env(devices: int, cheap_compile: bool = True, **extra: str) -> dict:
    """The environment of a CPU subprocess with `devices` simulated devices, no launcher's variables;
    the tests' cheaper compile and locations unless `cheap_compile=False` (tests/xla_flags.py)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MAXLITE_", "RAY_ADDRESS")) and (cheap_compile or k not in CHEAP_TRACE_ENV)}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices, cheap_compile),
               TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT, **(CHEAP_TRACE_ENV if cheap_compile else {}), **extra)
    return env


def run_module(module: str, args, processes: int = 1, devices: int = 2, timeout: float = 600,
               env: dict | None = None, prefix=()) -> tuple[list[int], list[str]]:
    """`python -m module args` on `processes` local processes (jax.distributed over gloo when
    several, `devices` simulated devices each): (exit codes, outputs with stderr merged). `prefix`:
    a command the process is exec'ed from (e.g. `sh -c '...; exec "$@"' sh`)."""
    import tempfile

    port = free_port()
    procs, logs = [], []
    for i in range(processes):
        extra = dict(MAXLITE_COORDINATOR=f"127.0.0.1:{port}", MAXLITE_NUM_PROCESSES=str(processes),
                     MAXLITE_PROCESS_ID=str(i)) if processes > 1 else {}
        logs.append(tempfile.TemporaryFile("w+"))  # files, not pipes: a full pipe would stall a peer
        procs.append(subprocess.Popen([*prefix, sys.executable, "-m", module, *args], cwd=ROOT,
                                      env={**process_env(devices, **extra), **(env or {})},
                                      stdout=logs[-1], stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + timeout
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    return codes, outs


def shown(outs: list[str], n: int = 3000) -> str:
    """Each process's output for a failure message: its last `n` characters once the C++ stack
    frames of a fatal log (`    @     0x...`) are left out, so the error above them is seen."""
    parts = []
    for i, out in enumerate(outs):
        kept = "\n".join(line for line in out.splitlines() if not line.lstrip().startswith("@     0x"))
        parts.append(f"--- process {i} ---\n{kept[-n:]}")
    return "\n".join(parts)


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on this machine (for test servers: emulator, Ray, Slurm)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n different free TCP ports: all held open until all are picked (one at a time, the system
    may hand the port it just freed out again: a Ray start given one port twice refuses to start)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float, poll: float = 0.5,
               alive: Callable[[], None] | None = None, context: Callable[[], str] = lambda: "") -> T:
    """Poll `check()` until it returns something truthy, and return that. `alive()` raises (an
    assertion) when what is awaited has died; the deadline only bounds a hung test, and its error
    carries `context()` (a log tail)."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s\n{context()}")
        time.sleep(poll)


# ---- damaging a checkpoint on purpose (the checksum tests) ----

def flip(path: str, offset: int, n: int = 4) -> None:
    """Invert `n` bytes of a file at `offset` (bit rot)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def largest_data_file(step_dir: str, item: str, process: int = 0) -> str:
    """The biggest OCDBT data file a process wrote for an array item of a local checkpoint step."""
    import glob
    import os
    return max(glob.glob(f"{step_dir}/{item}/ocdbt.process_{process}/d/*"), key=os.path.getsize)


def changed(root: str, step: int, item: str, before) -> set[str]:
    """The arrays of `item` whose values differ from `before` (a load of them while intact), read
    without verification: the independent account of what a damage did."""
    from maxlite import checkpoints as ck
    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), ck.restore.saved_tree(root, step, item))
    after = ck.restore_items(root, step, {item: target}, verify=False)[item]
    return {name for (name, a), (_, b) in zip(ck.checksums.leaves(before, item), ck.checksums.leaves(after, item))
            if not np.array_equal(a, b)}


def memory_cgroup(limit: int) -> str | None:
    """A child of this process's memory cgroup (v1, else v2) limited to `limit`; None if none can be made."""
    own = {parts[1]: parts[2] for parts in (line.split(":", 2) for line in open("/proc/self/cgroup")) if len(parts) == 3}
    for base, key, limit_file in ((f"/sys/fs/cgroup/memory{own.get('memory', '').strip()}", "memory", "memory.limit_in_bytes"),
                                  (f"/sys/fs/cgroup{own.get('', '').strip()}", "", "memory.max")):
        if key not in own or not os.path.isdir(base):
            continue
        path = f"{base}/maxlite-test-{os.getpid()}"
        try:
            os.mkdir(path)
            with open(f"{path}/{limit_file}", "w") as f:
                f.write(str(limit))
            return path
        except OSError:
            if os.path.isdir(path):
                os.rmdir(path)
    return None


def preset_names() -> list[str]:
    """Every shipped model preset (configs/models/*.yml)."""
    return sorted(p.stem for p in (C.CONFIG_DIR / "models").glob("*.yml"))


def shrunk(model_name: str) -> list[str]:
    """A preset at CPU size that keeps its traits: its family (with one whole period of its layer
    pattern: Gemma 3's 5 local + 1 global; a published Gemma 4: one local and one global layer), tied
    head or not, biases, RoPE scaling and local RoPE, a sliding window (8 of 32 tokens), query scaling, GQA (or not), a head_dim that is (or is not)
    emb/heads; a mixture of experts with at most 8 experts of width 32 (at most 1 dense layer first);
    latent attention with narrow latents (and DeepSeek sparse attention a narrow indexer keeping 8 of 32). Default dtypes
    (bf16 compute)."""
    from maxlite.models.families import family
    from maxlite.models.layout import layer_kinds

    cfg = C.load(["base.yml", f"model_name={model_name}"])
    kv = min(cfg.base_num_kv_heads, 2)
    heads = kv * min(cfg.base_num_query_heads // cfg.base_num_kv_heads, 2)
    proportional = cfg.base_num_query_heads * cfg.head_dim == cfg.base_emb_dim
    head_dim = 64 // heads if proportional else 24  # 24 · heads ≠ 64 for heads in 1, 2, 4
    layers = min(cfg.base_num_decoder_layers, max(2, len(family(cfg).layer_pattern)))
    window = [f"sliding_window={min(cfg.sliding_window, 8)}"] if cfg.sliding_window else []
    if any(k.mixer == "gated_deltanet" for k in layer_kinds(cfg)):  # narrow delta-net layers
        window += ["gdn_num_key_heads=2", "gdn_num_value_heads=4", "gdn_key_head_dim=16", "gdn_value_head_dim=16"]
    if any(k.mixer == "kda" for k in layer_kinds(cfg)):  # narrow Kimi delta attention: one head shape
        window += ["gdn_num_key_heads=2", "gdn_num_value_heads=2", "gdn_key_head_dim=16", "gdn_value_head_dim=16"]
    if cfg.num_experts:  # a MoE preset: a few narrow experts, still more than it routes to
        window += [f"num_experts={min(cfg.num_experts, 8)}", f"num_experts_per_tok={min(cfg.num_experts_per_tok, 4)}",
                   "base_moe_mlp_dim=32", f"first_num_dense_layers={min(cfg.first_num_dense_layers, 1)}"]
        if cfg.n_routing_groups > 0:  # groups of 4, the best of 2 open
            window += ["n_routing_groups=2", "topk_routing_group=1"]
    if cfg.chunk_attn_window_size:  # chunks of 8 of the 32 tokens; tempered queries from position 3 on
        window += [f"chunk_attn_window_size={min(cfg.chunk_attn_window_size, 8)}",
                   f"temperature_tuning_floor_scale={min(cfg.temperature_tuning_floor_scale, 4)}"]
    if cfg.attention_type == "mla":  # narrow latents, values narrower than queries and keys (as published)
        window += [f"q_lora_rank={min(cfg.q_lora_rank, 32)}", "kv_lora_rank=16", "qk_nope_head_dim=16",
                   "qk_rope_head_dim=8", "v_head_dim=16"]
    if any(k.mixer == "dsa" for k in layer_kinds(cfg)):  # a narrow indexer keeping 8 of the 32 tokens
        window += ["index_topk=8", "index_n_heads=4", "index_head_dim=16"]
    pattern = len(family(cfg).layer_pattern)
    if cfg.global_head_dim:  # Gemma 4: wider global layers with fewer kv heads, per-layer embeddings
        window += [f"global_head_dim={2 * head_dim}"]
    if cfg.global_num_kv_heads:
        window += [f"global_num_kv_heads={max(1, kv // 2)}"]
    if cfg.per_layer_embed_dim:
        window += ["per_layer_embed_dim=8"]
    if cfg.layer_types or cfg.num_kv_shared_layers:  # a small model keeps its pattern; a large one: a
        layers = cfg.base_num_decoder_layers     # period of the family's and 2 layers sharing keys/values
        if layers > pattern + 2:
            layers = pattern + 2 if cfg.num_kv_shared_layers else pattern
            window += ["layer_types=[]"] + (["num_kv_shared_layers=2"] if cfg.num_kv_shared_layers else [])
    if cfg.global_head_dim and layers > 4:  # a published Gemma 4: one local and one global layer (then a
        # pair reusing their keys/values), not its whole 5 : 1 period: the same kinds of layer, and a
        # third of the program (its unlike layers are unrolled within the period) to compile
        layers = 4 if cfg.num_kv_shared_layers else 2
        types = ", ".join(["sliding_attention", "full_attention"] * (layers // 2))
        window += [f"layer_types=[{types}]"] + (["num_kv_shared_layers=2"] if cfg.num_kv_shared_layers else [])
    if any(k.mixer == "mamba2" for k in layer_kinds(cfg)):  # narrow Mamba-2 layers; one block of each kind
        layers = 3
        window += ["mamba_num_heads=4", "mamba_head_dim=16", "mamba_state_dim=16", "mamba_num_groups=2",
                   "layer_types=[mamba, full_attention, mlp]"]
    if cfg.hc_mult:  # DeepSeek-V4: one layer of each attention (compressed every 8 and every 4 of the 32
        # tokens, the indexer keeping 3), the first hash-routed; a narrow query latent, RoPE on 8, 2 groups;
        # 3 Sinkhorn passes of the hyper-connections, not 20: XLA's compile of the unrolled passes grows
        # faster than their number (the training step's: 22.9 CPU-seconds with 20, 7.4 with 3, on a 2-core
        # AMD EPYC; benchmarks/results/sinkhorn_compile.json)
        layers = 3
        window += ["hc_sinkhorn_iters=3",
                   "layer_types=[sliding_attention, heavily_compressed_attention, compressed_sparse_attention]",
                   "num_hash_layers=1", "qk_rope_head_dim=8", "q_lora_rank=32", "o_groups=2", "o_lora_rank=16",
                   "index_n_heads=2", "index_head_dim=16", "index_topk=3", "compress_rate_hca=8", "compress_rate_csa=4"]
    if cfg.mrope_sections:  # multimodal RoPE over the narrow heads: every axis keeps frequencies
        half = int(head_dim * cfg.partial_rotary_factor) // 2
        window += [f"mrope_sections=[{half - 2 * (half // 3)}, {half // 3}, {half // 3}]"]
    if cfg.vision_encoder:  # a 2-layer tower of 32 wide (patch 8), DeepStack from its first layer; the
        # placeholder and marker ids inside the shrunk vocabulary
        window += ["vision_num_layers=2", "vision_emb_dim=32", "vision_mlp_dim=64", "vision_num_heads=2",
                   "vision_patch_size=8", "vision_num_positions=16", "image_token_id=500", "video_token_id=501",
                   "vision_start_token_id=502", "vision_end_token_id=503", "image_min_pixels=1024",
                   "image_max_pixels=9216", "max_image_patches=256"]
        window += ["vision_deepstack_layers=[0]"] if cfg.vision_deepstack_layers else []
        if cfg.vision_encoder == "siglip":  # 32-pixel squares: 4 × 4 patches pooled to 2 × 2 tokens
            window += ["vision_image_size=32", "vision_tokens_per_image=4"]
        if cfg.vision_encoder == "gemma4_vit":  # grouped kv heads of 16; up to 6 soft tokens an image
            window += ["vision_num_kv_heads=1", "vision_head_dim=16", "vision_tokens_per_image=6"]
    return ["base.yml", f"model_name={model_name}", "base_emb_dim=64", "base_mlp_dim=128",
            f"base_num_query_heads={heads}", f"base_num_kv_heads={kv}", f"head_dim={head_dim}",
            f"base_num_decoder_layers={layers}", "vocab_size=512", *window,
            "max_target_length=32", "per_device_batch_size=1", "enable_tensorboard=false",
            "write_report=false"]


def jax_logits(cfg, pure, ids):
    """maxlite's float32 logits [B, T, V] of a nested numpy params tree on token ids [B, T]."""
    from maxlite.state import abstract_params

    graphdef, state = abstract_params(cfg)  # no init: merge the structure with our values
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    B, T = ids.shape
    forward = nnx.jit(lambda m, *args: m(*args))
    return np.asarray(forward(model, ids, np.broadcast_to(np.arange(T), (B, T)), np.ones((B, T), np.int32)))


def greedy_paths(cfg, pure, model, prompt: list[int], n: int = 12) -> tuple[list[int], list[int]]:
    """(maxlite's greedy continuation of `prompt` from a nested numpy params tree, transformers'
    `generate` of the same from the torch `model`): n new tokens each."""
    import torch

    from maxlite.bridge import params as P
    from maxlite.generate import Sampling, generate_ids

    ours = generate_ids(cfg, P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure))), [prompt],
                        Sampling(max_new_tokens=n)).tokens[0]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    return ours, theirs


def plain_attention(q, k, v, seg, window=0, scale=None, sinks=None):
    """Attention written out plainly (kv heads repeated, an explicit [B, T, S] mask): key j visible
    to query i iff j <= i, same document, and i - j < window when window > 0; with `sinks` [N]
    (gpt-oss, as transformers' eager attention) each head's sink is one more column of the scores,
    dropped after the softmax."""
    import jax.numpy as jnp

    B, T, N, H = q.shape
    G = N // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    near = (j <= i) & ((i - j < window) if window else True)
    mask = near[None] & (np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :])
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) * (H ** -0.5 if scale is None else scale)
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    if sinks is not None:
        column = jnp.broadcast_to(sinks[None, :, None, None], (B, N, T, 1))
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(jnp.concatenate([scores, column], -1), -1)[..., :-1], v)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)


def assert_greedy_like_transformers(cfg, pure, model, new_tokens: int = 32, prompts=None, alone: bool = False):
    """maxlite's greedy decoding (batched prompts of different lengths, by default 12 and 3 tokens, with
    the KV cache) gives the tokens transformers' `generate` gives, on a varied path (not one token
    repeated); with `alone`, each prompt decoded by itself gives the same tokens as in the batch."""
    import torch

    from maxlite.bridge import params as P
    from maxlite.generate import Sampling, generate_ids

    prompts = prompts or [list(range(100, 112)), [7, 8, 9]]
    params = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    ours = generate_ids(cfg, params, prompts, Sampling(max_new_tokens=new_tokens)).tokens
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()
        assert len(set(got)) > 4, got
        if alone:
            assert generate_ids(cfg, params, [prompt], Sampling(max_new_tokens=new_tokens)).tokens == [got]


def selected_params(request, name: str) -> list:
    """The values of parameter `name` among the selected tests of the requesting module (after
    `pytest -k`), in collection order: a module fixture that computes for every case in one
    subprocess computes only what was selected."""
    values = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and name in params and params[name] not in values:
            values.append(params[name])
    return values


def value_and_grads(fn, params, x_BTD):
    """fn's output summed against a fixed random cotangent: its value and gradients in params and x_BTD."""
    import jax.numpy as jnp

    cotangent = jnp.asarray(np.random.default_rng(1).normal(0, 1, x_BTD.shape).astype(np.float32))
    return jax.value_and_grad(lambda p, x: jnp.sum(fn(p, x) * cotangent), argnums=(0, 1))(params, x_BTD)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def assert_import_sft_chat_export(tmp_path, config, class_name: str) -> None:
    """The journey as a user runs it, for a random transformers model of `config` (the bundled
    tokenizer, a ChatML template): `hf import` → SFT from the written recipe.yml on chat records (its
    loss falls) → `generate --chat` → `hf export` → transformers loads `class_name` and its greedy
    answer is maxlite's."""
    import json

    import torch
    import transformers

    from maxlite.data.tokenizer import BUNDLED_DIR

    def run(module: str, *args):
        return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=process_env(1),
                              capture_output=True, text=True, timeout=900)

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_DIR / "tokenizer.json"),
                                               eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"], "eos_token": "<|im_end|>"})
    tok.chat_template = CHATML
    config.vocab_size, config.eos_token_id, config.bos_token_id = 4104, tok.eos_token_id, None
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(str(tmp_path / "hf"))
    tok.save_pretrained(str(tmp_path / "hf"))
    rng = np.random.default_rng(0)
    with open(tmp_path / "chat.jsonl", "w") as f:
        for _ in range(48):
            a, b = rng.integers(0, 10, 2)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                             {"role": "assistant", "content": f"It is {a + b}."}]}) + "\n")
    done = run("maxlite.bridge.hf", "import", tmp_path / "hf", tmp_path / "ck")
    assert done.returncode == 0, done.stderr[-3000:]
    done = run("maxlite.train", tmp_path / "ck" / "recipe.yml", "dataset_type=sft",
               f"dataset_path={tmp_path / 'chat.jsonl'}", "sft_template=auto", "steps=6", "learning_rate=0.003",
               "max_target_length=32", "per_device_batch_size=4", "checkpoint_period=6", "eval_interval=0",
               "run_name=sft", f"base_output_directory={tmp_path}", "enable_tensorboard=false",
               "write_report=false", "dtype=float32")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "sft" / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses

    question = "What is 2 plus 3?"
    done = run("maxlite.generate", tmp_path / "sft", "--prompt", question, "--chat", "--max-new-tokens", "8",
               "dtype=float32")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(question), done.stdout
    ours = done.stdout.rstrip("\n")[len(question):]

    done = run("maxlite.bridge.hf", "export", tmp_path / "sft" / "checkpoints", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(model).__name__ == class_name
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    ids = back.apply_chat_template([{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8,
                             eos_token_id=back.eos_token_id, pad_token_id=0)  # the answer ends with its turn
    theirs = back.decode(out[0, len(ids):], skip_special_tokens=True)
    assert ours.strip() == theirs.strip() and ours.strip(), (ours, theirs)


def relative(a, b) -> float:
    """‖a − b‖ / ‖b‖: how far maxlite's numbers are from the reference's."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def torch_logits(model, ids):
    """A transformers model's float32 logits [B, T, V] on token ids [B, T] (numpy)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def imported_random_model(tmp_path_factory, name: str, overrides=()):
    """(the random transformers model `name` (tests/hf_models.py), its directory, maxlite's import of
    it as cfg and a nested numpy params tree): a module fixture's body. The model is saved in DIR/hf."""
    from maxlite.bridge import hf
    from tests import hf_models

    path = tmp_path_factory.mktemp(name)
    model = hf_models.model(name)
    model.save_pretrained(str(path / "hf"))
    cfg, pure = hf.import_hf(str(path / "hf"), list(overrides))
    return model, path, cfg, pure

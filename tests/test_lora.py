"""LoRA (maxlite/models/lora.py): only the adapters train and only they are in the optimizer state,
they shard like their base weights, a LoRA run resumes to the uninterrupted losses, and its merged
HF export and its PEFT adapter both compute what maxlite computes, in transformers and peft."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import PartitionSpec

from maxlite import api, checkpoints, config as C
from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.bridge.peft import export_peft
from maxlite.build import build
from maxlite.state import nbytes
from maxlite.train import train
from tests.helpers import SMALL

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LORA = [*SMALL, "lora_rank=4", "lora_alpha=8", "learning_rate=0.01", "warmup_steps_fraction=0", "lr_schedule_type=constant"]


def _flat(pure, prefix=()):
    for k, v in pure.items():
        if isinstance(v, dict):
            yield from _flat(v, (*prefix, str(k)))
        else:
            yield "/".join((*prefix, str(k))), v


def _spec(spec):
    """A PartitionSpec without its trailing unsplit dims (P(a, None) and P(a) shard alike)."""
    t = tuple(spec)
    while t and t[-1] is None:
        t = t[:-1]
    return PartitionSpec(*t)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"{run_dir}/metrics.jsonl")) if "loss" in r}


def test_only_adapters_train_shard_like_their_base_and_resume(tmp_path):
    argv = [*LORA, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", f"base_output_directory={tmp_path}",
            "checkpoint_period=0", "log_period=1"]
    built = build(C.load([*argv, "steps=6"]), jax.devices()[:8], num_processes=1)
    # optimizer state: Adam's two moments of the adapters, nothing of the base weights
    adapter_bytes = sum(x.nbytes for name, x in _flat(P.to_pure(jax.tree.map(
        lambda a: np.zeros(a.shape, a.dtype), built.abstract.params))) if "_lora_" in name)
    assert 2 * adapter_bytes <= nbytes(built.abstract.opt_state) < 2 * adapter_bytes + 1024
    # A [in, r] / B [r, out] take the base kernel's in / out shardings; the rank axis is not split
    from flax import nnx
    specs = {name: _spec(s.spec) for name, s in _flat(nnx.to_pure_dict(built.shardings.params))}
    base = specs["layers/attn/q"]  # [layers, embed, heads, head_dim]
    embed = ("fsdp", "context")  # the model dim over fsdp × context (context 1 here)
    layers = "stage"  # the layer stack over the pipeline axis (1 stage here)
    assert base == PartitionSpec(layers, embed, "tensor")
    assert specs["layers/attn/q_lora_a"] == PartitionSpec(layers, embed)
    assert specs["layers/attn/q_lora_b"] == PartitionSpec(layers, None, "tensor")
    assert specs["layers/mlp/down_lora_a"] == PartitionSpec(layers, "tensor")  # in: mlp
    assert specs["layers/mlp/down_lora_b"] == PartitionSpec(layers, None, embed)  # out: embed

    start = P.to_pure(built.init_state().params)
    train(C.load([*argv, "steps=4", "run_name=a"]))
    train(C.load([*argv, "steps=6", "run_name=a"]))  # resumes from the final checkpoint at step 4
    train(C.load([*argv, "steps=6", "run_name=b"]))
    a, b = _losses(f"{tmp_path}/a"), _losses(f"{tmp_path}/b")
    assert [a[s] for s in (5, 6)] == [b[s] for s in (5, 6)] and a[6] < a[1]
    _, trained = checkpoints.load_params(f"{tmp_path}/b/checkpoints")
    before = dict(_flat(start))
    moved = {name: not np.array_equal(x, before[name]) for name, x in _flat(P.to_pure(trained))}
    assert moved and all(moved[n] for n in moved if n.endswith("_lora_b"))  # B starts at zero and trains
    assert not any(moved[n] for n in moved if "_lora_" not in n)  # the base is frozen, bit for bit


HF_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=64)
HF_CONFIGS = {  # the families PEFT export covers; Gemma 3's window (4) is shorter than the 8 test tokens
    "llama": lambda: transformers.LlamaConfig(**HF_SMALL, num_hidden_layers=2, head_dim=16, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**HF_SMALL, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False),
    "gemma3": lambda: transformers.Gemma3TextConfig(**HF_SMALL, num_hidden_layers=6, head_dim=16, sliding_window=4,
                                                    query_pre_attn_scalar=16),
    # global layers with keys as values, the last two layers without k/v (v_proj adapted where it exists)
    "gemma4": lambda: transformers.Gemma4TextConfig(
        **HF_SMALL, num_hidden_layers=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=4, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2),
}


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_merged_export_and_peft_adapter_compute_what_maxlite_computes(family, tmp_path):
    peft = pytest.importorskip("peft")  # in the test extra; the skip is for installs without it
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[family]()).save_pretrained(str(tmp_path / "base_hf"))
    cfg, pure = hf.import_hf(str(tmp_path / "base_hf"), ["dtype=float32"])
    checkpoints.save_params(str(tmp_path / "base"), cfg, P.to_state(cfg, P.to_jax_inplace(pure)))

    run, _ = hf.import_hf(str(tmp_path / "base_hf"), [  # the imported model's keys, LoRA on top
        "lora_rank=4", "lora_alpha=8", "learning_rate=0.01", "warmup_steps_fraction=0", "max_target_length=16",
        "per_device_batch_size=1", "enable_tensorboard=false", "write_report=false", "dtype=float32", f"load_parameters_path={tmp_path}/base", "steps=4",
        "run_name=l", f"base_output_directory={tmp_path}", "checkpoint_period=0",
        "lora_targets=[q_proj, v_proj, o_proj, down_proj]"])
    train(run)
    lcfg, params = checkpoints.load_params(f"{tmp_path}/l/checkpoints")
    ids = np.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    ours = np.asarray(api.forward(api.model_from_params(lcfg, params), ids))
    base_logits = np.asarray(api.forward(api.model_from_params(cfg, P.to_state(cfg, P.to_jax_inplace(pure))), ids))
    assert np.abs(ours - base_logits).max() > 1e-3  # the adapters changed the model
    from maxlite.generate import Sampling, generate_ids  # decoding with the cache goes through the adapters
    assert generate_ids(lcfg, params, [ids[0].tolist()], Sampling(max_new_tokens=1)).tokens == [[int(ours[0, -1].argmax())]]

    hf.export_hf(lcfg, params, str(tmp_path / "merged"), tokenizer="none")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(merged(torch.tensor(ids)).logits.numpy(), ours, atol=2e-4)

    export_peft(lcfg, params, str(tmp_path / "adapter"), base_model=str(tmp_path / "base_hf"))
    base_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base_hf")).eval()
    with_adapter = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(with_adapter(torch.tensor(ids)).logits.numpy(), ours, atol=2e-4)


def test_lora_leaves_the_routing_bias_of_deepseek_moe_as_it_is():
    """DeepSeek-V3's routing biases move by the load (outside the optimizer) when the model trains, and
    stay under LoRA: the adapters alone train, and the exported adapter on its base must route alike."""
    from flax import nnx

    from maxlite import mesh as mesh_lib
    from maxlite.data.synthetic import make_synthetic_iterator
    from tests.helpers import build as build_one, shrunk

    def biases_after_two_steps(extra):
        cfg, mesh, state, step, sharding = build_one(shrunk("deepseek-v3") + extra, 1)
        data = make_synthetic_iterator(cfg, "train", 0, 1)
        before = [np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state.params))
                  if "router_bias" in jax.tree_util.keystr(p)]
        with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
            for _ in range(2):
                state, _ = step(state, {k: jax.device_put(v, sharding) for k, v in next(data).items()})
        after = [np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state.params))
                 if "router_bias" in jax.tree_util.keystr(p)]
        return before, after

    before, after = biases_after_two_steps([])
    assert before and any(np.any(a != b) for a, b in zip(after, before))  # the base trains: they move
    before, after = biases_after_two_steps(["lora_rank=4", "lora_targets=[o_proj]"])
    assert before and all(np.array_equal(a, b) for a, b in zip(after, before))


def test_dropout_is_unbiased_per_key_and_only_in_training(tmp_path):
    """lora_dropout: at step 0 (B = 0, so the output does not depend on the mask) B's gradient is
    linear in the dropped-out input, so its mean over many keys is the gradient without dropout;
    each key draws its own mask; a model call without a key (eval, decoding) has no dropout."""
    import jax.numpy as jnp
    from flax import nnx

    from maxlite import step as step_lib
    from maxlite.state import split_trainable

    built = build(C.load([*LORA, "lora_dropout=0.5", "max_target_length=8"]), jax.devices()[:1], num_processes=1)
    adapters, base = split_trainable(built.init_state().params)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 256, (1, 9)), jnp.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "positions": jnp.arange(8)[None],
             "segment_ids": jnp.ones((1, 8), jnp.int32), "weights": jnp.ones((1, 8), jnp.float32)}

    @jax.jit
    def grad_b(key):
        g, _, _ = step_lib.gradients(adapters, built.graphdef, batch, 1, step_lib.lm_loss(), base, key)
        return g["layers"]["mlp"]["down_lora_b"][...]

    plain = np.asarray(grad_b(None))
    draws = np.stack([np.asarray(grad_b(jax.random.key(i))) for i in range(256)])
    assert np.abs(plain).max() > 0 and not np.allclose(draws[0], draws[1])
    spread = draws.std(0) / np.sqrt(len(draws))  # the mean's standard error, per entry
    assert np.all(np.abs(draws.mean(0) - plain) < 5 * spread + 1e-7)
    assert np.abs(draws[0] - plain).max() > 10 * spread.max()  # one draw alone is not the mean

    # eval with a dropout recipe computes what the same weights compute without dropout
    trained = jax.tree.map(lambda a: a + 0.05, adapters)  # B ≠ 0: the adapters change the output
    params = nnx.merge_state(trained, base)
    plain_graph = build(C.load([*LORA, "max_target_length=8"]), jax.devices()[:1], num_processes=1).graphdef
    ours = step_lib.eval_step(params, batch, graphdef=built.graphdef)["loss_sum"]
    assert float(ours) == float(step_lib.eval_step(params, batch, graphdef=plain_graph)["loss_sum"])
    assert float(ours) != float(step_lib.eval_step(nnx.merge_state(adapters, base), batch, graphdef=plain_graph)["loss_sum"])


def test_dropout_run_resumes_to_the_uninterrupted_losses(tmp_path):
    """The masks are a function of (seed, step, micro-batch): a run stopped at step 2 and resumed
    draws the masks the uninterrupted run drew; dropout changes the trajectory."""
    argv = [*LORA, f"base_output_directory={tmp_path}", "checkpoint_period=0", "log_period=1",
            "per_device_batch_size=2", "gradient_accumulation_steps=2", "ici_data_parallelism=1"]
    train(C.load([*argv, "lora_dropout=0.3", "steps=2", "run_name=a"]))
    train(C.load([*argv, "lora_dropout=0.3", "steps=4", "run_name=a"]))
    train(C.load([*argv, "lora_dropout=0.3", "steps=4", "run_name=b"]))
    train(C.load([*argv, "steps=4", "run_name=c"]))
    a, b, c = (_losses(f"{tmp_path}/{r}") for r in "abc")
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]
    assert b[4] != c[4]


def test_lora_is_refused_in_one_line_for_a_family_without_gated_projections():
    with pytest.raises(C.ConfigError, match="LoRA is available for gated-MLP families .*not gpt3"):
        C.load(["base.yml", "model_name=gpt3-126m", "lora_rank=4"])
    assert C.load(["base.yml", "model_name=gemma3-1b", "lora_rank=4"]).lora_rank == 4


VISION_TARGETS = {"qwen3_vl": "[q_proj, v_proj, o_proj, down_proj]", "qwen3_5": "[q_proj, in_proj_qkv, out_proj, down_proj]",
                  "gemma3": "[q_proj, v_proj, o_proj, down_proj]", "gemma4": "[q_proj, v_proj, o_proj, down_proj]"}


@pytest.mark.parametrize("family", sorted(VISION_TARGETS))
def test_peft_adapter_of_a_vision_model_loads_on_its_multimodal_class(family, tmp_path):
    """A LoRA run on an imported vision-language model (Qwen3VL / Qwen3_5 / Gemma3 / Gemma4ForConditionalGeneration, the
    tower frozen, trained on image rows): peft finds every adapter tensor on the multimodal class
    (its decoder under model.language_model.) and computes maxlite's LoRA model's logits."""
    peft = pytest.importorskip("peft")
    from tests.hf_models import gemma3_vl, gemma4_vl, qwen3_5_vl, qwen3_vl

    torch.manual_seed(0)
    config = {"qwen3_vl": qwen3_vl, "qwen3_5": qwen3_5_vl, "gemma3": gemma3_vl, "gemma4": gemma4_vl}[family]()
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(str(tmp_path / "base_hf"))
    cfg, pure = hf.import_hf(str(tmp_path / "base_hf"), ["dtype=float32"])
    checkpoints.save_params(str(tmp_path / "base"), cfg, P.to_state(cfg, P.to_jax_inplace(pure)))
    run, _ = hf.import_hf(str(tmp_path / "base_hf"), [
        "lora_rank=4", "lora_alpha=8", "learning_rate=0.01", "warmup_steps_fraction=0", "max_target_length=32",
        "max_image_patches=64", "per_device_batch_size=1", "enable_tensorboard=false", "write_report=false",
        "dtype=float32", f"load_parameters_path={tmp_path}/base", "steps=3", "run_name=l",
        f"base_output_directory={tmp_path}", "checkpoint_period=0", f"lora_targets={VISION_TARGETS[family]}"])
    train(run)
    lcfg, params = checkpoints.load_params(f"{tmp_path}/l/checkpoints")
    ids = np.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    ours = np.asarray(api.forward(api.model_from_params(lcfg, params), ids))
    base_logits = np.asarray(api.forward(api.model_from_params(cfg, P.to_state(cfg, P.to_jax_inplace(pure))), ids))
    assert np.abs(ours - base_logits).max() > 1e-3  # the adapters changed the model

    export_peft(lcfg, params, str(tmp_path / "adapter"), base_model=str(tmp_path / "base_hf"))
    base_model = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "base_hf")).eval()
    with_adapter = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")).eval()
    from safetensors.numpy import load_file
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    loaded = {k for k in with_adapter.state_dict() if "lora_" in k}
    # every tensor written is one peft placed (its names drop the adapter's ".default")
    assert {k.replace(".weight", ".default.weight") for k in written} <= loaded, sorted(written)[:3]
    assert all(".language_model." in k for k in loaded), sorted(loaded)[:3]  # none on the tower (SigLIP's q_proj)
    with torch.no_grad():
        np.testing.assert_allclose(with_adapter(input_ids=torch.tensor(ids)).logits.numpy(), ours, atol=2e-4)

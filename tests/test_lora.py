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
    assert base == PartitionSpec(None, "fsdp", "tensor")
    assert specs["layers/attn/q_lora_a"] == PartitionSpec(None, "fsdp")
    assert specs["layers/attn/q_lora_b"] == PartitionSpec(None, None, "tensor")
    assert specs["layers/mlp/down_lora_a"] == PartitionSpec(None, "tensor")  # in: mlp
    assert specs["layers/mlp/down_lora_b"] == PartitionSpec(None, None, "fsdp")  # out: embed

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


def test_merged_export_and_peft_adapter_compute_what_maxlite_computes(tmp_path):
    peft = pytest.importorskip("peft")  # in the test extra; the skip is for installs without it
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "base_hf"))
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
    merged = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(merged(torch.tensor(ids)).logits.numpy(), ours, atol=2e-4)

    export_peft(lcfg, params, str(tmp_path / "adapter"), base_model=str(tmp_path / "base_hf"))
    base_model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "base_hf")).eval()
    with_adapter = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(with_adapter(torch.tensor(ids)).logits.numpy(), ours, atol=2e-4)

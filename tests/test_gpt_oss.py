"""gpt-oss (maxlite/families/gpt_oss/; its import, logits, greedy decoding and export against
transformers are tests/test_bridge_hf_families.py's): its experts (router bias, expert biases,
clamped SwiGLU) equal a per-token loop in every MoE implementation and with the expert axis, values
and gradients; MXFP4 experts import to the values transformers dequantizes; a random
GptOssForCausalLM with its own tokenizer and a harmony-format chat template fine-tunes with SFT and
LoRA, and the PEFT adapter on transformers' model computes and decodes what maxlite does; the
presets' active parameters are the model card's."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from maxlite import api, checkpoints, config as C
from maxlite.bridge import hf, mxfp4
from maxlite.bridge import params as P
from maxlite.generate import Sampling, generate_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8
# as gpt-oss's tokenizer: <|endoftext|> separates documents, <|return|> ends an answer
SPECIALS = ["<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>"]
# the harmony format's shape (ours, not the published template): roles between <|start|> and
# <|message|>, answers on the final channel, a turn ends with <|end|>
HARMONY = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")
CHAT = [{"role": "user", "content": "In the beginning"}, {"role": "assistant", "content": "God created"}]


def _tokenizer(directory):
    """A byte-level BPE of its own with harmony's special tokens (built here: no download)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["In the beginning God created the heaven and the earth.", "And God said, Let there be light."] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|end|>")
    fast.chat_template = HARMONY
    fast.save_pretrained(str(directory))
    return fast


def hf_config(**kw):
    """4 experts (top 2) of width 32, a clamp low enough to bite, a window of 8 (layer 0 local),
    gpt-oss's YaRN (not truncated) over a shorter original context."""
    return transformers.GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=256, initializer_range=0.3, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0}, **kw)


def save_hf(path, **kw):
    """A random model whose every bias, sink and norm is perturbed (HF starts some at 0 or 1, where a
    dropped or swapped one would not show)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("_bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(str(path))
    _tokenizer(path)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "hf"
    model = save_hf(path)
    cfg, pure = hf.import_hf(str(path), ["max_target_length=64"])
    return path, model, cfg, pure


# ---- the experts: every implementation against a per-token loop --------------------------------

def _moe_cfg(**overrides):
    argv = ["base.yml", "model_name=tiny-gpt-oss", "dtype=float32", "base_emb_dim=16", "base_moe_mlp_dim=8",
            "num_experts=8", "num_experts_per_tok=2", "max_target_length=8", "mlp_activations_limit=0.5"]
    return C.load(argv + [f"{k}={v}" for k, v in overrides.items()])


def _loop_reference(cfg, p, x_BTD, kept):
    """Token by token as transformers' GptOssMLP: router logits + bias, the top k logits, their
    softmax, each chosen expert's interleaved-free gate/up (+ biases), clamped SwiGLU, down + bias."""
    limit, k = cfg.mlp_activations_limit, cfg.num_experts_per_tok

    def one_token(x, keep):
        logits = x @ p["router"] + p["router_logit_bias"]
        top, order = jax.lax.top_k(logits, k)
        w = jax.nn.softmax(top)
        y = jnp.zeros_like(x)
        for j in range(k):
            e = order[j]
            gate = jnp.minimum(x @ p["gate"][e] + p["gate_bias"][e], limit)
            up = jnp.clip(x @ p["up"][e] + p["up_bias"][e], -limit, limit)
            h = (up + 1) * gate * jax.nn.sigmoid(1.702 * gate)
            y = y + keep[j] * w[j] * (h @ p["down"][e] + p["down_bias"][e])
        return y

    return jax.vmap(jax.vmap(one_token))(x_BTD, kept)


NAMES = ("router", "router_logit_bias", "gate", "up", "down", "gate_bias", "up_bias", "down_bias")


@pytest.mark.parametrize("impl,capacity,ep", [("dense", -1, 1), ("ragged", -1, 1), ("blocked", -1, 1),
                                              ("megablox", -1, 1), ("capacity", 0.5, 1), ("ragged", -1, 4),
                                              ("capacity", 0.5, 4)])
def test_experts_equal_a_per_token_loop_in_every_implementation(impl, capacity, ep):
    """ep = 4: on 8 devices, the experts (and their biases) split over expert 4 × fsdp 2, each
    device's tokens sent to their experts and back."""
    import contextlib

    from flax import nnx
    from maxlite import mesh as mesh_lib
    from maxlite.models import moe

    cfg = _moe_cfg(moe_implementation=impl, capacity_factor=capacity)
    with nnx.use_eager_sharding(False):
        layer = moe.MoE(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    params = {n: jnp.asarray(getattr(layer, n)[...] * (8 if n in ("router", "gate", "up") else 1)
                             + rng.normal(0, 0.3, getattr(layer, n)[...].shape).astype(np.float32)) for n in NAMES}
    x = jnp.asarray(rng.normal(0, 1, (8, 6, 16)).astype(np.float32))
    graphdef, state = nnx.split(layer)

    def ours(p, x):
        state_ = jax.tree.map(lambda a: a, state)
        nnx.replace_by_pure_dict(state_, {**nnx.to_pure_dict(state_), **p})
        return nnx.merge(graphdef, state_).routed(x)[0]

    slots = moe.capacity(cfg, 6)
    routing = moe.route(cfg, x, params["router"], None, jnp.ones((8, 6), bool), slots, params["router_logit_bias"])
    kept = routing.kept_BTk.astype(jnp.float32)
    assert (slots == 0) == bool(kept.all())  # capacity drops some, the dropless ones none
    cot = jnp.asarray(rng.normal(0, 1, x.shape).astype(np.float32))
    grads = lambda fn: jax.value_and_grad(lambda p, x: jnp.sum(fn(p, x) * cot), argnums=(0, 1))(params, x)  # noqa: E731
    on_mesh = contextlib.nullcontext()
    if ep > 1:
        mesh_cfg = C.resolve(_moe_cfg(ici_expert_parallelism=ep, ici_fsdp_parallelism=8 // ep), 8)
        mesh = mesh_lib.make_mesh(mesh_cfg, jax.devices()[:8])
        on_mesh = contextlib.ExitStack()
        on_mesh.enter_context(jax.set_mesh(mesh))
        on_mesh.enter_context(nnx.logical_axis_rules(mesh_lib.RULES))
    with on_mesh:
        (value, (g_p, g_x)) = grads(jax.jit(ours))
    (ref, (r_p, r_x)) = grads(jax.jit(lambda p, x: _loop_reference(cfg, p, x, kept)))
    np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_x, r_x, rtol=1e-4, atol=1e-5)
    for n in NAMES:
        np.testing.assert_allclose(g_p[n], r_p[n], rtol=1e-4, atol=1e-5, err_msg=n)
    # the clamp bit: some gate above the limit, some up beyond it
    pre = jnp.einsum("btd,edf->btef", x, params["gate"]) + params["gate_bias"][None, None]
    assert float(pre.max()) > cfg.mlp_activations_limit


# ---- MXFP4 ---------------------------------------------------------------------------------------

def test_mxfp4_experts_import_to_what_transformers_dequantizes(imported, tmp_path):
    """The experts' matrices stored as MXFP4 blocks and scales (the published checkpoints' form)
    import to transformers' own dequantization of them; every other tensor as stored."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, _, cfg, _ = imported
    rng = np.random.default_rng(0)
    tensors = load_file(str(path / "model.safetensors"))
    expected = {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        E, n_in, n_out = tensors.pop(name).shape
        blocks = rng.integers(0, 256, (E, n_out, n_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(120, 130, (E, n_out, n_in // 32), dtype=np.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                    dtype=torch.float32).numpy()
        np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales), expected[name])
        # values that came from MXFP4 quantize back to themselves (the export below is exact on them)
        np.testing.assert_array_equal(mxfp4.dequantize(*mxfp4.quantize(expected[name])), expected[name])
    (tmp_path / "q").mkdir()
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    qcfg, pure = hf.import_hf(str(tmp_path / "q"))
    gate_up = expected["model.layers.1.mlp.experts.gate_up_proj"]
    layer = lambda leaf: P.layer_leaf(pure, qcfg, 1, ("mlp", leaf))  # noqa: E731
    np.testing.assert_array_equal(layer("gate"), gate_up[..., ::2])
    np.testing.assert_array_equal(layer("up"), gate_up[..., 1::2])
    np.testing.assert_array_equal(layer("down"), expected["model.layers.1.mlp.experts.down_proj"])


@pytest.mark.parametrize("model_name, published", [("gpt-oss-20b", "3.61"), ("gpt-oss-120b", "5.13")])
def test_active_parameters_match_the_model_card(model_name, published):
    """OpenAI's card counts active parameters without the input embedding table (a lookup)."""
    from maxlite.models.flops import active_param_count, param_count
    from maxlite.state import abstract_params

    cfg = C.load(["base.yml", f"model_name={model_name}"])
    active = active_param_count(cfg, param_count(abstract_params(cfg)[1])) - cfg.vocab_size * cfg.base_emb_dim
    assert f"{active / 1e9:.2f}" == published


def test_sft_with_its_harmony_template_and_lora_exported_for_peft(imported, tmp_path):
    """LoRA on the attention projections, SFT on conversations rendered with the checkpoint's own
    (harmony) template; `generate --chat` renders a prompt as transformers does; the PEFT adapter on
    transformers' model decodes what maxlite decodes."""
    peft = pytest.importorskip("peft")
    from maxlite.data.chat import ChatTemplate
    from maxlite.data.tokenizer import load_tokenizer
    from maxlite.train import train

    path, _, cfg, pure = imported
    checkpoints.save_params(str(tmp_path / "base"), cfg, P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure))))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                            + "\n" for q, a in [("In the beginning", "God created"), ("And God said", "Let there be light")] * 8))
    run, _ = hf.import_hf(str(path), [
        "dataset_type=sft", f"dataset_path={data}", "lora_rank=4", "lora_alpha=8",
        "lora_targets=[q_proj, k_proj, v_proj, o_proj]", "learning_rate=0.02", "warmup_steps_fraction=0",
        "max_target_length=32", "per_device_batch_size=2", "steps=4", "eval_interval=0", "checkpoint_period=0",
        f"load_parameters_path={tmp_path}/base", "run_name=sft", f"base_output_directory={tmp_path}",
        "enable_tensorboard=false", "write_report=false", "dtype=float32", "sample_prompts=[]"])
    train(run)
    lcfg, params = checkpoints.load_params(f"{tmp_path}/sft/checkpoints")
    tok = load_tokenizer(lcfg.tokenizer_path, lcfg.bos_id, lcfg.eos_id)
    template = ChatTemplate.for_config(lcfg, tok)
    fast = transformers.AutoTokenizer.from_pretrained(str(path))
    question = [{"role": "user", "content": "In the beginning"}]
    assert template.render(question, True) == fast.apply_chat_template(question, add_generation_prompt=True,
                                                                       tokenize=False)
    ids, mask = template.encode(CHAT)
    # the answer, and only it, supervised: its channel, its text, the end of its turn
    assert fast.decode(ids[mask].tolist()) == "<|channel|>final<|message|>God created<|end|>"

    prompt = fast.apply_chat_template(question, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ours = generate_ids(lcfg, params, [prompt], Sampling(max_new_tokens=8)).tokens[0]
    base_logits = np.asarray(api.forward(api.model_from_params(cfg, P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))),
                                         np.array([prompt])))
    tuned_logits = np.asarray(api.forward(api.model_from_params(lcfg, params), np.array([prompt])))
    assert np.abs(tuned_logits - base_logits).max() > 1e-3  # the adapters trained

    from maxlite.bridge.peft import export_peft
    export_peft(lcfg, params, str(tmp_path / "adapter"), base_model=str(path))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tuned = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(tuned(torch.tensor([prompt])).logits.numpy(), tuned_logits, atol=2e-4)
        out = tuned.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                             eos_token_id=None, pad_token_id=0)
    assert ours == out[0, len(prompt):].tolist()


def test_an_mxfp4_export_loads_in_transformers_with_our_logits(imported, tmp_path):
    """`--dtype mxfp4`: the experts' matrices as blocks and scales (the rest bfloat16), which
    transformers loads (dequantizing) to the logits maxlite computes from the same files."""
    from tests.helpers import jax_logits

    _, _, cfg, pure = imported
    hf.export_hf(cfg, pure, str(tmp_path / "q"), dtype="mxfp4", tokenizer="none")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    qcfg, qpure = hf.import_hf(str(tmp_path / "q"), ["dtype=float32"])
    gate = P.layer_leaf(pure, cfg, 0, ("mlp", "gate"))
    lossy = mxfp4.dequantize(*mxfp4.quantize(gate.astype(np.float32)))
    np.testing.assert_array_equal(P.layer_leaf(qpure, qcfg, 0, ("mlp", "gate")), lossy)
    assert 0 < np.abs(lossy - gate).max() <= 0.25 * np.abs(gate).max()  # 4 bits: lossy, within a step
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "q"), dtype=torch.float32).eval()
    ids = np.random.default_rng(2).integers(0, 320, (2, 24))
    with torch.no_grad():
        theirs = back(torch.tensor(ids)).logits.float().numpy()
    ours = jax_logits(qcfg, qpure, ids)
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) <= 1e-5
    llama = C.load(["base.yml", "model_name=tiny"])
    with pytest.raises(ValueError, match="has no MXFP4 form"):
        hf.export_hf(llama, P.random_params(llama), str(tmp_path / "no"), dtype="mxfp4")


# openai/gpt-oss-20b's config.json as published (transformers 4.x keys: rope_scaling, rope_theta)
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088}


def test_the_published_config_imports_as_the_preset_and_the_preset_exports_it():
    from maxlite.families.gpt_oss import hf as gpt_oss
    from maxlite.schema import MODEL_KEYS

    imported = C.load(["base.yml"], **gpt_oss.config_overrides(PUBLISHED_20B))
    preset = C.load(["base.yml", "model_name=gpt-oss-20b"])
    assert {k: getattr(imported, k) for k in MODEL_KEYS} == {k: getattr(preset, k) for k in MODEL_KEYS}
    exported = gpt_oss.hf_config(preset, "bfloat16")
    for key in ("hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok", "sliding_window",
                "layer_types", "swiglu_limit", "attention_bias", "head_dim", "num_key_value_heads", "vocab_size"):
        assert exported[key] == PUBLISHED_20B[key], key
    assert {k: v for k, v in exported["rope_parameters"].items() if k not in ("type", "rope_theta")} == \
        PUBLISHED_20B["rope_scaling"]

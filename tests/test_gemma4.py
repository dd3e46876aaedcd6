"""Gemma 4 (text), built small and random by transformers (tests/hf_models.py) with every trait of the
family at once — per-layer embeddings, the last layers sharing keys and values (with double-wide MLPs),
wide global layers with fewer kv heads whose keys are the values, proportional RoPE, soft-capped logits
—: import → float32 logits equal transformers' over a batch longer than the window (relative error ≤
1e-5), greedy decoding of 32 tokens identical to `generate` (the windows wrapping in the cache), export
→ transformers loads it and computes the same logits, with the tokenizer and chat template; the text
model of a multimodal checkpoint imports; what maxlite does not model is refused in one line."""

import json

import numpy as np
import pytest
import torch
import transformers

from maxlite import config as C
from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.data.tokenizer import BUNDLED_DIR
from maxlite.models.kinds import cache_numbers_per_token
from tests import hf_models
from tests.helpers import assert_greedy_like_transformers, jax_logits
from tests.hf_models import GEMMA4_TYPES, WINDOW

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, T = 4096, 40  # the bundled tokenizer's vocabulary; sequences well past the window
TEMPLATE = ("{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"  # Gemma 4's
            "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")  # turns


def _saved(tmp_path_factory, name: str):
    """A random HF model (tests/hf_models.py) saved with the bundled tokenizer and Gemma 4's turns."""
    path = tmp_path_factory.mktemp("gemma4") / "hf"
    model = hf_models.model(name)
    model.save_pretrained(str(path))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_DIR / "tokenizer.json"),
                                               eos_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    return model, path


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return _saved(tmp_path_factory, "gemma4")


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """The MoE variant: a dense MLP beside 4 experts (top 2) in every layer."""
    return _saved(tmp_path_factory, "gemma4_moe")


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _import_equal_decode_and_export(model, path, tmp_path):
    """(cfg, pure) of the import, after: logits equal, greedy decoding identical, export equal."""
    cfg, pure = hf.import_hf(str(path), ["max_target_length=64"])
    ids = np.random.default_rng(1).integers(0, V, (2, T))
    theirs = _logits(model, ids)
    assert _relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5
    # greedy: 32 tokens, batched prompts of different lengths, the windows wrapping in the cache
    assert_greedy_like_transformers(cfg, pure, model)
    # export: transformers loads it as the same architecture and computes our logits
    hf.export_hf(cfg, pure, str(tmp_path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(back) is type(model) and back.config.layer_types == GEMMA4_TYPES
    assert back.config.kv_sharing_modes == model.config.kv_sharing_modes
    assert _relative(_logits(back, ids), theirs) <= 1e-5
    return cfg, pure


def test_moe_variant_imports_decodes_and_exports(hf_moe, tmp_path):
    cfg, pure = _import_equal_decode_and_export(*hf_moe, tmp_path)
    assert (cfg.decoder_block, cfg.num_experts, cfg.num_experts_per_tok, cfg.base_moe_mlp_dim) == \
        ("gemma4_moe", 4, 2, 32)
    assert hf.read_hf_config(str(tmp_path / "back"))["enable_moe_block"] is True


def test_import_logits_greedy_decoding_export_and_tokenizer(hf_model, tmp_path):
    model, path = hf_model
    cfg, pure = _import_equal_decode_and_export(model, path, tmp_path)
    assert (cfg.decoder_block, cfg.dtype, cfg.sliding_window) == ("gemma4", "float32", WINDOW)
    assert (cfg.global_head_dim, cfg.global_num_kv_heads, cfg.num_kv_shared_layers) == (32, 1, 2)
    assert "v" not in pure["layers"]["blocks"][2]["attn"]  # keys are the values in global layers
    assert "k" not in pure["layers"]["blocks"][5]["attn"]  # a sharing layer has no projections

    # the sharing layers keep no decode cache: the model's cache is its 3 local and 1 global layers' own
    K, H, Kg, Hg = 2, 16, 1, 32
    assert cache_numbers_per_token(cfg, 64) == (3 * 2 * K * H * WINDOW + 2 * Kg * Hg * 64) / 64

    # the tokenizer and chat template come back with the export
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    chat = [{"role": "user", "content": "In the beginning"}, {"role": "assistant", "content": "God created"}]
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert again.apply_chat_template(chat, tokenize=False) == \
        "<|turn>user\nIn the beginning<turn|>\n<|turn>model\nGod created<turn|>\n"


def test_sft_with_its_own_chat_template_and_lora_on_an_imported_gemma4(hf_model, tmp_path):
    """The imported model fine-tunes on the bundled chat set with its own template (answers only),
    adapters on every projection it has, the base frozen; the exported PEFT adapter loads."""
    from maxlite import checkpoints
    from maxlite.bridge.peft import export_peft
    from maxlite.train import train

    _, path = hf_model
    base, pure = hf.import_hf(str(path))
    checkpoints.save_params(str(tmp_path / "base"), base, P.to_state(base, P.to_jax_inplace(pure)))
    run, _ = hf.import_hf(str(path), [
        "dataset_type=sft", "sft_template=auto", "lora_rank=4", "lora_alpha=8", "steps=3", "learning_rate=0.01",
        "max_target_length=64", "per_device_batch_size=2", "checkpoint_period=0", "eval_interval=0",
        "enable_tensorboard=false", "write_report=false", f"load_parameters_path={tmp_path}/base", "run_name=sft",
        f"base_output_directory={tmp_path}", "lora_targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"])
    train(run)
    audit = (tmp_path / "sft" / "sft_audit.txt").read_text()
    assert "<|turn>model" in audit, audit[:500]
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "sft" / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 3 and all(np.isfinite(losses))
    cfg, params = checkpoints.load_params(f"{tmp_path}/sft/checkpoints")
    tuned = P.to_pure(params)
    assert "k_lora_a" in tuned["layers"]["blocks"][0]["attn"] and "k_lora_a" not in tuned["layers"]["blocks"][5]["attn"]
    assert "gate_lora_a" in tuned["layers"]["blocks"][5]["mlp"]  # the MLPs adapted too
    out = export_peft(cfg, params, str(tmp_path / "adapter"), base_model=str(path))
    assert (out / "adapter_model.safetensors").is_file()


def test_the_text_model_of_a_multimodal_checkpoint_imports(tmp_path):
    """Gemma4ForConditionalGeneration: config.json nests text_config (the published global keys,
    `global_head_dim`, absent: transformers' per-layer config is written instead), the tensors sit
    under model.language_model. beside a vision tower we leave behind."""
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                             patch_size=4, position_embedding_size=64)
    text = hf_models.gemma4_text(hidden_size_per_layer_input=0, num_kv_shared_layers=0, final_logit_softcapping=None)
    config = transformers.Gemma4Config(text_config=text.to_dict(),
                                       vision_config=vision.to_dict(), audio_config=None)
    torch.manual_seed(0)
    full = hf_models.gemma4_perturbed(transformers.Gemma4ForConditionalGeneration(config).eval())
    full.save_pretrained(str(tmp_path / "mm"))
    cfg, pure = hf.import_hf(str(tmp_path / "mm"))
    assert (cfg.decoder_block, cfg.global_head_dim, cfg.per_layer_embed_dim) == ("gemma4", 32, 0)
    ids = np.random.default_rng(3).integers(0, 256, (1, T))  # text tokens only
    with torch.no_grad():
        theirs = full(input_ids=torch.tensor(ids)).logits.float().numpy()
    assert _relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5


def test_an_audio_tower_stays_behind_and_the_import_says_so(tmp_path, capsys):
    """Gemma4ForConditionalGeneration with an audio tower (the E2B / E4B checkpoints): one line names
    what stays behind; the text model imports with transformers' text logits and exports with no audio."""
    audio = transformers.Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           subsampling_conv_channels=[8, 4], output_proj_dims=32)
    text = hf_models.gemma4_text(hidden_size_per_layer_input=0, num_kv_shared_layers=0, final_logit_softcapping=None)
    config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=audio.to_dict())
    torch.manual_seed(0)
    full = transformers.Gemma4ForConditionalGeneration(config).eval()
    audio_tensors = [n for n in full.state_dict() if n.startswith(("model.audio_tower.", "model.embed_audio."))]
    assert audio_tensors
    full.save_pretrained(str(tmp_path / "mm"))
    cfg, pure = hf.import_hf(str(tmp_path / "mm"))
    assert f"its audio tower and audio embedder ({len(audio_tensors)} tensors) stay behind" in capsys.readouterr().err
    ids = np.random.default_rng(4).integers(0, 256, (1, T))
    with torch.no_grad():
        theirs = full(input_ids=torch.tensor(ids)).logits.float().numpy()
    assert _relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5
    hf.export_hf(cfg, pure, str(tmp_path / "out"), tokenizer="none")
    from safetensors import safe_open
    names = [n for f in (tmp_path / "out").glob("*.safetensors") for n in safe_open(str(f), "np").keys()]
    assert names and not [n for n in names if "audio" in n]


def test_gemma4_text_defaults_are_transformers_own():
    """A multimodal config.json's text_config states only what differs from these."""
    from maxlite.families.gemma4.hf import DEFAULT_ROPE, TEXT_DEFAULTS

    theirs = transformers.Gemma4TextConfig().to_dict()
    for key, value in TEXT_DEFAULTS.items():
        assert theirs[key] == value, key
    assert theirs["rope_parameters"] == DEFAULT_ROPE


@pytest.mark.parametrize("config, message", [
    (dict(model_type="gemma4", vision_config={"hidden_size": 32}, audio_config={"hidden_size": 32}),
     "gemma4 without a text_config (vision_config, audio_config only)"),
    (dict(model_type="gemma4_vision"), "a Gemma 4 tower (gemma4_vision, gemma4_audio) is not a causal LM"),
    (dict(model_type="gemma4_text", enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8,
          use_double_wide_mlp=True, num_hidden_layers=3, layer_types=["full_attention"] * 3, num_kv_shared_layers=1),
     "use_double_wide_mlp with enable_moe_block"),
    (dict(model_type="gemma4_text", num_hidden_layers=2, layer_types=["full_attention"] * 2, num_kv_shared_layers=2),
     "has no earlier layer of its kind"),
])
def test_what_maxlite_does_not_model_is_refused_in_one_line(config, message, tmp_path, capsys):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=V)
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    assert hf.main(["import", str(tmp_path), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("argv, message", [
    (["decoder_block=llama2", "global_head_dim=64"], "global_head_dim shapes Gemma 4's layers"),
    (["model_name=gemma4-tiny", "layer_types=[full_attention,full_attention,full_attention,full_attention,"
      "sliding_attention,full_attention]", "num_kv_shared_layers=3"], "no layer before the sharing ones is local"),
])
def test_recipes_gemma4_cannot_run_are_refused(argv, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load(["base.yml", *argv])

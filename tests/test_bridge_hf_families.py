"""Qwen2, Qwen3, Gemma 3 (text; also with a layer pattern of its own), Mistral with a sliding window, OLMo
3, gpt-oss, Mistral 4 (latent attention + DeepSeekMoE), MiniMax-M2, Nemotron-H (Mamba-2) and Llama 4 (chunks of 8: the greedy
paths run past several), each built small and random by transformers
(tests/hf_models.py): import → float32 logits equal transformers' over a batch longer than the window
(relative error ≤ 1e-5), greedy decoding of 32 tokens identical to `generate`, export → transformers
loads it and its logits equal ours, the tokenizer and chat template come back unchanged, and the
compute dtype config.json states is the one the import records."""

import json

import numpy as np
import pytest
import torch
import transformers

from maxlite import config as C
from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.data.tokenizer import BUNDLED_DIR
from tests import hf_models
from tests.helpers import assert_greedy_like_transformers, jax_logits
from tests.hf_models import WINDOW

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, T = 4096, 40  # the bundled tokenizer's vocabulary; sequences well past the window
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


FAMILIES = ["qwen2", "qwen3", "gemma3", "gemma3-own-pattern", "mistral", "olmo3", "gpt_oss", "mistral4", "minimax_m2",
            "nemotron_h", "llama4_text"]
DECODER_BLOCK = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "gemma3-own-pattern": "gemma3",
                 "mistral": "llama2", "olmo3": "olmo3", "gpt_oss": "gpt_oss", "mistral4": "mistral4",
                 "minimax_m2": "minimax_m2", "nemotron_h": "nemotron_h", "llama4_text": "llama4"}


def _hf_model(family, path, dtype=torch.float32):
    """A random HF model (tests/hf_models.py) saved with its tokenizer and chat template."""
    model = hf_models.model(family)
    model.to(dtype).save_pretrained(str(path))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_DIR / "tokenizer.json"),
                                               eos_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("family", FAMILIES)
def test_import_logits_greedy_export_and_tokenizer_round_trip(family, tmp_path):
    model = _hf_model(family, tmp_path / "hf")
    cfg, pure = hf.import_hf(str(tmp_path / "hf"), ["max_target_length=64"])
    assert cfg.decoder_block == DECODER_BLOCK[family] and cfg.dtype == "float32"  # as config.json states
    if family in ("gemma3", "gemma3-own-pattern", "mistral", "olmo3", "gpt_oss"):
        assert cfg.sliding_window == WINDOW
    if family == "gemma3-own-pattern":  # imported as the checkpoint states it, not refused
        assert list(cfg.layer_types) == model.config.layer_types
    ids = np.random.default_rng(1).integers(0, V, (2, T))
    theirs = _logits(model, ids)
    assert _relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5

    # greedy: 32 tokens, batched prompts of different lengths, the windows wrapping in the cache
    assert_greedy_like_transformers(cfg, pure, model)

    # export: transformers loads it as the same architecture and computes our logits
    hf.export_hf(cfg, pure, str(tmp_path / "back"))
    back = hf_models.auto_class(family).from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    assert back.config.to_dict().get("layer_types") == model.config.to_dict().get("layer_types")
    assert _relative(_logits(back, ids), theirs) <= 1e-5
    # the tokenizer and chat template come back as they were
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    chat = [{"role": "user", "content": "In the beginning"}, {"role": "assistant", "content": "God created"}]
    mine, again = (transformers.AutoTokenizer.from_pretrained(str(tmp_path / d)) for d in ("hf", "back"))
    assert again.apply_chat_template(chat) == mine.apply_chat_template(chat)
    assert again.apply_chat_template(chat, tokenize=False) == "<|user|>In the beginning\n<|assistant|>God created\n"


def test_a_bfloat16_checkpoint_imports_to_bfloat16_compute_unless_told_otherwise(tmp_path):
    _hf_model("qwen3", tmp_path / "hf", dtype=torch.bfloat16)
    assert hf.import_hf(str(tmp_path / "hf"))[0].dtype == "bfloat16"
    assert hf.import_hf(str(tmp_path / "hf"), ["dtype=float32"])[0].dtype == "float32"


def test_gemma3_text_defaults_are_transformers_own():
    """A multimodal config.json's text_config states only what differs from these."""
    from maxlite.families.gemma3.hf import TEXT_DEFAULTS

    theirs = transformers.Gemma3TextConfig().to_dict()
    rope = theirs["rope_parameters"]
    theirs.update(rope_theta=rope["full_attention"]["rope_theta"],
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    for key, value in TEXT_DEFAULTS.items():
        assert theirs[key] == value, key


def test_a_multimodal_gemma3_checkpoint_imports_its_text_model(tmp_path):
    """The hub's Gemma 3 4B-27B are Gemma3ForConditionalGeneration: config.json nests text_config,
    the tensors sit under the language model's prefix beside the vision tower (imported with it:
    tests/test_gemma3_vision.py); on text alone the logits are transformers'."""
    text = hf_models.config("gemma3")
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    torch.manual_seed(0)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4)
    full = transformers.Gemma3ForConditionalGeneration(config).eval()
    full.save_pretrained(str(tmp_path / "mm"))
    cfg, pure = hf.import_hf(str(tmp_path / "mm"))
    assert (cfg.decoder_block, cfg.sliding_window, cfg.base_num_decoder_layers) == ("gemma3", WINDOW, 7)
    ids = np.random.default_rng(3).integers(0, 256, (1, T))  # text tokens only
    with torch.no_grad():
        theirs = full(input_ids=torch.tensor(ids)).logits.float().numpy()
    assert _relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5


@pytest.mark.parametrize("config, message", [
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
     "sliding windows on layers 1..1 only"),
    (dict(model_type="gemma3_text", final_logit_softcapping=30.0), "softcapping"),
    (dict(model_type="gemma3_text", layer_types=["full_attention", "chunked_attention"]),
     "chunked_attention layers are Llama 4's"),
    (dict(model_type="olmo3", rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 5e5}}),
     "sliding-window layers with yarn RoPE scaling are not modelled"),
    (dict(model_type="qwen3", rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}),
     "rope type 'longrope' is not supported"),
    (dict(model_type="mistral4", max_position_embeddings=1048576, rope_parameters={
        "rope_type": "yarn", "factor": 128.0, "rope_theta": 1e4, "original_max_position_embeddings": 8192,
        "llama_4_scaling_beta": 0.1}), "llama_4_scaling_beta=0.1 scales queries past position 8192"),
    (dict(model_type="mistral4", n_group=4, topk_group=2), "groups scored by their best two softmax scores"),
    (dict(model_type="minimax_m2", scoring_func="softmax"), "is not the layer transformers' MiniMaxM2ForCausalLM"),
    (dict(model_type="kimi_linear", mla_use_nope=False), "mla_use_nope=false (RoPE in the latent attention"),
    (dict(model_type="kimi_linear", linear_attn_config={"use_full_rank_gate": True}), "use_full_rank_gate"),
    (dict(model_type="deepseek_v3", q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8,
          v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, index_topk=8,
          index_n_heads=4), "which model_type deepseek_v32 has"),
    (dict(model_type="deepseek_v32", q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8,
          v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, index_topk=8,
          index_n_heads=4, index_head_dim=16, layer_types=["indexed_attention", "full_attention"]),
     "sparse attention (indexed_attention) in every layer"),
    (dict(model_type="deepseek_v32", q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8,
          v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, index_topk=8,
          index_n_heads=4, index_head_dim=16), "the indexer reads the query latent"),
    (dict(model_type="nemotron_h", layers_block_type=["linear_attention", "moe"]), "block type 'moe' is not modelled"),
    (dict(model_type="llama4_text", attention_chunk_size=None), "attention_chunk_size=null (no chunked layers)"),
    (dict(model_type="llama4_text", num_experts_per_tok=2), "num_experts_per_tok=2: Llama 4's router weight"),
    (dict(model_type="llama4_text", num_hidden_layers=4, moe_layers=[0, 1]), "moe_layers=[0, 1] is not every"),
    (dict(model_type="llama4_text", num_hidden_layers=4, no_rope_layers=[1, 0, 1, 1],
          layer_types=["chunked_attention"] * 4), "are chunked with RoPE or global without it"),
])
def test_what_maxlite_does_not_model_is_refused_in_one_line(config, message, tmp_path, capsys):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=V)
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    assert hf.main(["import", str(tmp_path), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_exports_that_the_architecture_cannot_hold_are_refused(tmp_path):
    qwen2 = C.load(["base.yml", "model_name=tiny", "decoder_block=qwen2"])  # use_bias=false
    with pytest.raises(ValueError, match="Qwen2 always has q/k/v biases"):
        hf.export_hf(qwen2, P.random_params(qwen2), str(tmp_path / "a"))
    scaled = C.load(["base.yml", "model_name=tiny", "query_pre_attn_scalar=10"])
    with pytest.raises(ValueError, match="scales scores by 1/sqrt"):
        hf.export_hf(scaled, P.random_params(scaled), str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_checkpoint_whose_tensors_do_not_match_its_config_is_one_line(tmp_path, capsys):
    """A tensor missing or of another shape is the user's checkpoint, not a converter bug: exit 2."""
    from safetensors.numpy import save_file

    model = _hf_model("qwen3", tmp_path / "hf")
    weights = {n: p.detach().numpy() for n, p in model.state_dict().items()}
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    capsys.readouterr()  # transformers' own progress lines
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err  # the import's progress lines, then one error line
    assert err.strip().splitlines()[-1].startswith("maxlite: error: ") and \
        "tensor model.layers.1.mlp.down_proj.weight missing" in err.strip().splitlines()[-1], err


def test_the_published_multimodal_llama4_imports_as_its_text_model(tmp_path, capfd):
    """Scout and Maverick are published as Llama4ForConditionalGeneration (`model_type: llama4`, the text
    model's config in `text_config`, its tensors under `language_model.`): the import reads the text
    model, with transformers' logits on text, says in one line that the vision tower and projector stay
    behind, and exports the text model (Llama4ForCausalLM) with the same logits."""
    text = hf_models.config("llama4_text")
    vision = transformers.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28, patch_size=14,
        vision_output_dim=32, projector_input_dim=32, projector_output_dim=text.hidden_size, pixel_shuffle_ratio=0.5)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=V - 1)).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama4"
    capfd.readouterr()
    cfg, pure = hf.import_hf(str(tmp_path / "hf"), ["max_target_length=64"])
    assert "tensors of the vision tower and projector (vision_model.*, multi_modal_projector.*) not imported" \
        in capfd.readouterr().err
    assert cfg.decoder_block == "llama4" and cfg.vocab_size == text.vocab_size
    ids = np.random.default_rng(1).integers(0, text.vocab_size, (2, T))
    theirs = _logits(model, ids)
    assert _relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5
    hf.export_hf(cfg, pure, str(tmp_path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(back).__name__ == "Llama4ForCausalLM"
    assert _relative(_logits(back, ids), theirs) <= 1e-5

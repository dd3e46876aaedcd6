"""GLM-4.5 (maxlite/families/glm4_moe/) built small and random by transformers (tests/hf_models.py),
with a tokenizer and chat template of its own and its multi-token-prediction layer as the published
checkpoints store it: import → float32 logits equal transformers' (relative error ≤ 1e-5) with half-
rotary RoPE, q/k norms, q/k/v biases, a dense first layer, grouped sigmoid routing with a nonzero
choice bias, a shared expert and scaled weights; greedy decoding identical to `generate`; export →
transformers loads it, computes the same logits, and the tokenizer comes back unchanged."""

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.data.tokenizer import BUNDLED_DIR
from maxlite.generate import Sampling, generate_ids
from tests import hf_models
from tests.helpers import jax_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, T = 4096, 24  # the bundled tokenizer's vocabulary
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(the transformers model (tests/hf_models.py), its directory): saved with a tokenizer, and a
    multi-token-prediction layer (model.layers.3.*) added to its file as GLM publishes it."""
    path = tmp_path_factory.mktemp("glm") / "hf"
    model = hf_models.model("glm4_moe")
    model.save_pretrained(str(path))
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(2)
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "self_attn.q_proj.weight",
                 "mlp.experts.0.gate_proj.weight", "shared_head.norm.weight"):
        tensors[f"model.layers.3.{name}"] = rng.normal(0, 1, (4, 4)).astype(np.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_DIR / "tokenizer.json"),
                                               eos_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path))
    return model, path


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def _relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_import_logits_greedy_export_and_tokenizer(glm, tmp_path, capsys):
    model, path = glm
    cfg, pure = hf.import_hf(str(path), ["max_target_length=64"])
    assert "6 tensors of GLM's multi-token-prediction layer" in capsys.readouterr().err
    assert (cfg.decoder_block, cfg.partial_rotary_factor, cfg.use_qk_norm, cfg.first_num_dense_layers) == \
        ("glm4_moe", 0.5, True, 1)
    assert (cfg.n_routing_groups, cfg.topk_routing_group, cfg.routed_scaling_factor) == (4, 2, 2.5)
    ids = np.random.default_rng(1).integers(0, V, (2, T))
    theirs = _logits(model, ids)
    assert _relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5

    prompt = list(range(100, 110))
    ours = generate_ids(cfg, P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure))), [prompt],
                        Sampling(max_new_tokens=16)).tokens[0]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                             eos_token_id=None, pad_token_id=0)
    assert ours == out[0, len(prompt):].tolist() and len(set(ours)) > 4, ours

    hf.export_hf(cfg, pure, str(tmp_path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    assert sum(p.numel() for p in back.parameters()) == sum(p.numel() for p in model.parameters())
    assert _relative(_logits(back, ids), theirs) <= 1e-5
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    chat = [{"role": "user", "content": "In the beginning"}]
    mine, again = (transformers.AutoTokenizer.from_pretrained(str(d)) for d in (path, tmp_path / "back"))
    assert again.apply_chat_template(chat) == mine.apply_chat_template(chat)


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "silu-gated"),
    ({"model_type": "glm4_moe", "n_routed_experts": 6, "n_group": 4, "topk_group": 2}, "n_routing_groups=4"),
])
def test_what_maxlite_does_not_model_is_refused_in_one_line(glm, change, message, tmp_path):
    _, path = glm
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), **change}))
    for name in ("model.safetensors",):
        (tmp_path / name).symlink_to(path / name)
    with pytest.raises(hf.C.ConfigError, match=message):
        hf.import_hf(str(tmp_path))

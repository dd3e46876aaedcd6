"""DeepSeek-V2 (no query latent, softmax routing in groups) and DeepSeek-V3 (query latent, sigmoid
routing with the expert bias, in groups), both with YaRN RoPE and its softmax factor, built small
and random by transformers, with a word tokenizer and chat template of
their own: import → float32 logits equal transformers' (relative error ≤ 1e-5), greedy decoding
through the latent cache equals `generate`, export → transformers loads the same architecture and
computes the same logits, the tokenizer and template come back unchanged."""

import jax
import numpy as np
import pytest
import torch
import transformers

from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.generate import Sampling, generate_ids
from tests.helpers import jax_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, T = 256, 12
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
SMALL = dict(hidden_size=32, num_attention_heads=4, vocab_size=V, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
             kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=6, max_position_embeddings=64,
             initializer_range=0.3, tie_word_embeddings=False)


def _yarn(mscale, mscale_all_dim):
    """YaRN stretching a 16-token context 4 times (DeepSeek's 4,096 × 40), its softmax factor."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale_all_dim}


def _config(version):
    if version == "deepseek_v3":  # groups of 4 experts, each token in the best 1 of 2; weights × 2.5
        return transformers.DeepseekV3Config(**SMALL, num_key_value_heads=4, q_lora_rank=16, n_shared_experts=1,
                                             n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                             rope_parameters=_yarn(1.0, 0.8))
    # DeepSeek-V2-Lite's mscale; groups by their best softmax score
    return transformers.DeepseekV2Config(**SMALL, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5,
                                         topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                         rope_parameters=_yarn(0.707, 0.707))


def _word_tokenizer(directory):
    import tokenizers

    vocab = {f"w{i}": i for i in range(V - 1)} | {"<eos>": V - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(directory))


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def imported(request, tmp_path_factory):
    """(the HF model, its directory, the imported config and params)."""
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(request.param)).eval()
    with torch.no_grad():  # norms start at 1 and the expert bias at 0, where a dropped one would not show
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.ndim == 1 and "inv_freq" not in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(str(path / "hf"))
    _word_tokenizer(path / "hf")
    cfg, pure = hf.import_hf(str(path / "hf"), ["max_target_length=32"])
    yield model, path, cfg, pure
    jax.clear_caches()


def _relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_import_gives_transformers_logits_and_greedy_path(imported):
    model, _, cfg, pure = imported
    assert cfg.attention_type == "mla" and cfg.decoder_block == "deepseek"
    ids = np.random.default_rng(1).integers(0, V - 1, (2, T))
    assert _relative(jax_logits(cfg, pure, ids), _logits(model, ids)) <= 1e-5

    prompt = list(range(10, 18))
    ours = generate_ids(cfg, P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure))), [prompt],
                        Sampling(max_new_tokens=12)).tokens[0]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs and len(set(ours)) > 3, (ours, theirs)


def test_export_loads_in_transformers_with_the_same_logits_and_tokenizer(imported):
    model, path, cfg, pure = imported
    hf.export_hf(cfg, pure, str(path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    ids = np.random.default_rng(2).integers(0, V - 1, (2, T))
    assert _relative(_logits(back, ids), _logits(model, ids)) <= 1e-5
    assert (path / "back" / "tokenizer.json").read_bytes() == (path / "hf" / "tokenizer.json").read_bytes()
    shipped = [f for f in hf.TOKENIZER_FILES if (path / "hf" / f).is_file()]
    assert any(TEMPLATE in (path / "hf" / f).read_text() for f in shipped)  # the template is among them
    for name in shipped:
        assert (path / "back" / name).read_bytes() == (path / "hf" / name).read_bytes(), name

"""Recipe → Megatron-LM / NeMo 2.0: the values, per preset, not just that it runs."""

import dataclasses
import json

import pytest

from maxlite import config as C
from maxlite.bridge import nemo
from maxlite.models.families import family
from maxlite.models.kinds import FEED_FORWARDS, MIXERS

PRESETS = sorted(p.stem for p in (C.CONFIG_DIR / "models").glob("*.yml"))


def mapping(*args, nodes=1, gpus=8):
    return nemo.map_recipe(C.load(["base.yml", *args]), nodes, gpus)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_maps_its_architecture(preset):
    cfg = C.load(["base.yml", f"model_name={preset}"])
    if family(cfg).post_norms:  # Gemma 3: see the refusal test
        return
    if "linear" in family(cfg).layer_pattern:  # the Qwen3.5 hybrids: refused in one line
        layers = "Kimi delta attention layers" if cfg.decoder_block == "kimi_linear" else "gated delta-net layers"
        with pytest.raises(C.ConfigError, match=f"cannot express .*{layers}"):
            nemo.map_recipe(cfg)
        return
    if "mamba" in family(cfg).layer_pattern:  # Nemotron-H: refused in one line
        with pytest.raises(C.ConfigError, match="cannot express .*Mamba-2 layers"):
            nemo.map_recipe(cfg)
        return
    if family(cfg).moe:  # not mapped yet: refused in one line
        with pytest.raises(C.ConfigError, match="cannot express a mixture of experts"):
            nemo.map_recipe(cfg)
        return
    m = nemo.map_recipe(cfg)
    a, n = m.megatron_dict(), dict(m.nemo)
    gpt3 = cfg.decoder_block == "gpt3"
    assert a["--num-layers"] == n["recipe.model.config.num_layers"] == cfg.base_num_decoder_layers
    assert a["--hidden-size"] == n["recipe.model.config.hidden_size"] == cfg.base_emb_dim
    assert a["--ffn-hidden-size"] == n["recipe.model.config.ffn_hidden_size"] == cfg.base_mlp_dim
    assert a["--num-attention-heads"] == cfg.base_num_query_heads
    assert a["--kv-channels"] == n["recipe.model.config.kv_channels"] == cfg.head_dim
    assert n["recipe.model.config.num_query_groups"] == cfg.base_num_kv_heads
    gqa = cfg.base_num_kv_heads < cfg.base_num_query_heads
    assert ("--group-query-attention" in a) == gqa
    assert a.get("--num-query-groups") == (cfg.base_num_kv_heads if gqa else None)
    assert a["--seq-length"] == cfg.max_target_length
    assert a["--position-embedding-type"] == ("learned_absolute" if gpt3 else "rope")
    assert a["--normalization"] == ("LayerNorm" if gpt3 else "RMSNorm")
    assert ("--swiglu" in a) == (not gpt3) and ("--openai-gelu" in a) == gpt3
    assert a["--norm-epsilon"] == cfg.normalization_layer_epsilon
    assert ("--untie-embeddings-and-output-weights" in a) == (not cfg.logits_via_embedding)
    assert n["recipe.model.config.share_embeddings_and_output_weights"] == cfg.logits_via_embedding
    all_biases = cfg.use_bias and family(cfg).biases == "all"
    assert ("--disable-bias-linear" in a) == (not all_biases)
    assert ("--add-qkv-bias" in a) == n["recipe.model.config.add_qkv_bias"] == (cfg.use_bias and not all_biases)
    assert ("--qk-layernorm" in a) == n["recipe.model.config.qk_layernorm"] == family(cfg).qk_norm
    if gpt3:
        assert a["--max-position-embeddings"] == cfg.max_position_embeddings
        assert "--rotary-base" not in a
    else:
        assert a["--rotary-base"] == n["recipe.model.config.rotary_base"] == cfg.rope_max_timescale
        scaled = cfg.rope_scaling_factor > 0
        assert ("--use-rope-scaling" in a) == scaled
        if scaled:
            assert a["--rope-scaling-factor"] == n["recipe.model.config.scale_factor"] == cfg.rope_scaling_factor
            assert n["recipe.model.config.old_context_len"] == cfg.rope_original_max_position
    # the padded Megatron vocabulary is exactly vocab_size
    step = a["--make-vocab-size-divisible-by"] * a["--tensor-model-parallel-size"]
    assert cfg.vocab_size % step == 0
    assert m.factory_exact == (preset in nemo.NEMO_FACTORIES)


@pytest.mark.parametrize("preset,expected", [
    ("llama3.1-8b", {"--num-layers": 32, "--hidden-size": 4096, "--ffn-hidden-size": 14336,
                     "--num-attention-heads": 32, "--num-query-groups": 8, "--rotary-base": 500000,
                     "--rope-scaling-factor": 8.0}),
    ("llama3.2-1b", {"--num-layers": 16, "--hidden-size": 2048, "--kv-channels": 64,
                     "--num-query-groups": 8, "--rope-scaling-factor": 32.0}),
    ("llama2-7b", {"--num-layers": 32, "--ffn-hidden-size": 11008, "--rotary-base": 10000}),
    ("mistral-7b", {"--rotary-base": 1000000, "--num-query-groups": 8}),
    ("gpt3-126m", {"--num-layers": 12, "--hidden-size": 768, "--max-position-embeddings": 2048}),
])
def test_known_values(preset, expected):
    a = mapping(f"model_name={preset}").megatron_dict()
    for flag, value in expected.items():
        assert a[flag] == value, flag
    if preset == "llama3.2-1b":
        assert "--untie-embeddings-and-output-weights" not in a  # Llama 3.2 ties embeddings
    if preset == "gpt3-126m":
        assert "--disable-bias-linear" not in a and "--swiglu" not in a


def test_parallelism_batch_and_schedule():
    m = mapping("model_name=tiny", "ici_tensor_parallelism=2", "per_device_batch_size=2",
                "gradient_accumulation_steps=4", "steps=1000", "warmup_steps_fraction=0.05",
                "learning_rate=6e-4", "learning_rate_final_fraction=0.1", "adam_b2=0.95",
                "gradient_clipping_threshold=0.5", nodes=2, gpus=8)
    a, n = m.megatron_dict(), dict(m.nemo)
    # 16 GPUs: tensor 2 → Megatron data parallel 8; maxlite's 2 sequences per device × 2 devices of a
    # tensor group = 4 per data-parallel rank; global = 2 × 16 × 4 accumulation = 128
    assert a["--tensor-model-parallel-size"] == 2 and a["--pipeline-model-parallel-size"] == 1
    assert a["--micro-batch-size"] == 4 and a["--global-batch-size"] == 128
    assert a["--global-batch-size"] // (a["--micro-batch-size"] * 16 // 2) == 4  # accumulation
    assert n["recipe.data.global_batch_size"] == 128 and n["recipe.trainer.num_nodes"] == 2
    assert "--use-distributed-optimizer" in a  # fsdp=8 → DP + distributed optimizer
    assert any("fsdp=8" in note for note in m.not_mapped)
    assert (a["--lr"], a["--min-lr"], a["--lr-decay-style"]) == (6e-4, 6e-5, "cosine")
    assert (a["--lr-warmup-iters"], a["--lr-decay-iters"], a["--train-iters"]) == (50, 1000, 1000)
    assert (a["--adam-beta2"], a["--clip-grad"], a["--weight-decay"]) == (0.95, 0.5, 0.1)
    assert "--bf16" in a and n["recipe.trainer.plugins.precision"] == "bf16-mixed"
    assert n["recipe.optim.lr_scheduler.min_lr"] == 6e-5 and n["recipe.optim.lr_scheduler.warmup_steps"] == 50
    assert a["--recompute-granularity"] == "full"


def test_pipeline_stages_and_the_circular_schedules_virtual_stages():
    m = mapping("model_name=tiny", "base_num_decoder_layers=8", "ici_pipeline_parallelism=4", "num_pipeline_repeats=2",
                "num_pipeline_microbatches=8", "per_device_batch_size=2", nodes=1, gpus=8)
    a, n = m.megatron_dict(), dict(m.nemo)
    # 8 GPUs: pipeline 4 → Megatron data parallel 2, each rank's 2 × 4 = 8 sequences in 8 micro-batches;
    # 8 layers = 4 stages × 2 virtual stages of 1 layer
    assert a["--pipeline-model-parallel-size"] == 4 and n["recipe.trainer.strategy.pipeline_model_parallel_size"] == 4
    assert a["--micro-batch-size"] == 1 and a["--global-batch-size"] == 16
    assert a["--global-batch-size"] // (a["--micro-batch-size"] * 8 // 4) == 8  # micro-batches per batch
    assert a["--num-layers-per-virtual-pipeline-stage"] == 1
    assert n["recipe.trainer.strategy.virtual_pipeline_model_parallel_size"] == 2


def test_data_prefix_blend_and_split():
    m = mapping("model_name=tiny", "dataset_type=indexed", "data_prefix=[1,/d/web,3,/d/code]",
                "data_split=98,2,0")
    a, n = m.megatron_dict(), dict(m.nemo)
    assert a["--data-path"] == ["0.25", "/d/web", "0.75", "/d/code"]
    assert a["--split"] == "98,2,0" and n["recipe.data.split"] == "98,2,0"
    assert n["recipe.data.paths"] == [0.25, "/d/web", 0.75, "/d/code"]
    assert {"--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"} <= set(a)
    assert "--mock-data" not in a
    separate = mapping("model_name=tiny", "dataset_type=indexed", "data_prefix=/d/train",
                       "eval_data_prefix=/d/valid").megatron_dict()
    assert separate["--train-data-path"] == ["1", "/d/train"] and separate["--valid-data-path"] == ["1", "/d/valid"]
    synthetic = mapping("model_name=tiny").megatron_dict()
    assert "--mock-data" in synthetic and synthetic["--vocab-size"] == 4095  # NullTokenizer adds one


def test_what_does_not_map_is_said():
    m = mapping("model_name=llama3.1-8b", "z_loss_weight=1e-4", "remat_policy=save_dots",
                "rope_high_freq_factor=2.0", "weight_dtype=bfloat16", "dtype=float32")
    text = "\n".join(m.not_mapped)
    assert "z_loss_weight" in text and "remat_policy=save_dots" in text
    assert "rope_high_freq_factor=2.0" in text and "weight_dtype=bfloat16" in text
    assert "scan_layers" in text
    a = m.megatron_dict()
    assert "--bf16" not in a and a["--recompute-granularity"] == "selective"


def test_cli_formats(capsys):
    assert nemo.main(["base.yml", "model_name=llama3-8b", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    argv = out["megatron_args"]
    assert argv[argv.index("--num-query-groups") + 1] == "8" and out["nemo_factory"] == "llama3_8b"
    assert nemo.main(["base.yml", "model_name=tiny", "--format", "megatron"]) == 0
    text = capsys.readouterr().out
    assert "pretrain_gpt.py \\" in text and "    --num-layers 4 \\" in text and "recipe." not in text
    assert nemo.main(["base.yml", "model_name=tiny", "--format", "nemo"]) == 0
    text = capsys.readouterr().out
    assert "recipe.model.config.num_layers=4" in text and "llm.llama3_8b" in text
    assert "recipe.trainer.strategy.tensor_model_parallel_size=1" in text


def test_cli_user_error_is_one_line(capsys):
    assert nemo.main(["base.yml", "model_name=tiny", "ici_tensor_parallelism=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("maxlite: error: ")


SCHEDULES = [  # every schedule optax can run from a recipe
    ["lr_schedule_type=cosine", "warmup_steps_fraction=0.1"],
    ["lr_schedule_type=linear", "warmup_steps_fraction=0.25", "learning_rate_final_fraction=0.3"],
    ["lr_schedule_type=constant", "warmup_steps_fraction=0.2"],
    ["lr_schedule_type=cosine", "warmup_steps_fraction=0"],
    ["lr_schedule_type=cosine", "learning_rate_schedule_steps=30"],  # steps past the schedule's end
    *(["lr_schedule_type=wsd", "wsd_decay_steps_fraction=0.3", f"wsd_decay_style={style}"]
      for style in ("linear", "cosine", "1-sqrt")),
    ["lr_schedule_type=wsd", "learning_rate_schedule_steps=30", "lr_warmup_steps=3"],
]


@pytest.mark.parametrize("keys", SCHEDULES, ids=lambda k: " ".join(k))
def test_megatron_runs_the_schedule_optax_runs(keys):
    """The exported --lr* flags, fed to megatron-core's own OptimizerParamScheduler, give optax's
    learning rate at every step."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from maxlite.optim import learning_rate_schedule

    cfg = C.load(["base.yml", "steps=40", "learning_rate=1e-3", *keys])
    a = nemo.map_recipe(cfg).megatron_dict()

    class Optimizer:  # what the scheduler sets the rate on
        param_groups = [{}]

    sched = OptimizerParamScheduler(
        Optimizer(), init_lr=0.0, max_lr=a["--lr"], min_lr=a["--min-lr"], lr_warmup_steps=a["--lr-warmup-iters"],
        lr_decay_steps=a["--lr-decay-iters"], lr_decay_style=a["--lr-decay-style"], start_wd=0.0, end_wd=0.0,
        wd_incr_steps=1, wd_incr_style="constant", wsd_decay_steps=a.get("--lr-wsd-decay-iters"),
        lr_wsd_decay_style=a.get("--lr-wsd-decay-style"))
    optax_lr = learning_rate_schedule(cfg)
    for step in range(a["--train-iters"]):
        assert sched.get_lr({}) == pytest.approx(float(optax_lr(step)), rel=1e-5, abs=1e-12), step
        sched.step(1)


def test_each_kind_declares_its_mapping_or_its_refusal():
    for kind in (*MIXERS.values(), *FEED_FORWARDS.values()):
        assert bool(kind.megatron) != bool(kind.megatron_refusal), kind.name
        assert kind.megatron_refusal or callable(kind.megatron_function()), kind.name


@pytest.mark.parametrize("args, own", [
    (["model_name=tiny", "attention_type=mla", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=8",
      "v_head_dim=8"], "multi-head latent attention (not mapped yet"),
    (["model_name=gemma4-tiny"], "Gemma 4's attention (a v norm"),
    (["model_name=kimi-linear-48b-a3b"], "Kimi delta attention layers (its GPT layer is attention only)"),
])
def test_a_kind_is_refused_in_its_own_words(args, own):
    """Each kind the layers use says what Megatron cannot express of it, and no other kind's line
    appears (a gated delta-net line once stood for every mixer but grouped-query attention)."""
    with pytest.raises(C.ConfigError, match="cannot express") as e:
        mapping(*args)
    assert own in str(e.value) and "gated delta-net" not in str(e.value)


def test_the_mapping_asks_the_kinds_not_a_list_of_features(monkeypatch):
    """A kind's declaration is all nemo.py reads: refused there, a llama model is refused."""
    monkeypatch.setitem(MIXERS, "attention", dataclasses.replace(
        MIXERS["attention"], megatron="", megatron_refusal="a made-up attention"))
    with pytest.raises(C.ConfigError, match="cannot express a made-up attention; train it with maxlite"):
        mapping("model_name=tiny")


def test_what_megatron_cannot_schedule_is_refused_in_one_line():
    cfg = C.load(["base.yml", "train_objective=dpo", "dataset_type=preference", "alignment_sft_steps=10",
                  "alignment_sft_learning_rate=1e-3"])
    with pytest.raises(C.ConfigError, match="alignment_sft_steps") as e:
        nemo.map_recipe(cfg)
    assert "\n" not in str(e.value)


def test_gemma3_is_refused_in_one_line_and_windows_and_qk_norms_map(capsys):
    assert nemo.main(["base.yml", "model_name=gemma3-4b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot express norms after attention and after the MLP" in err[0], err
    a, n = (lambda m: (m.megatron_dict(), dict(m.nemo)))(mapping("model_name=mistral-7b", "sliding_window=4096"))
    assert a["--window-size"] == [4095, 0] and n["recipe.model.config.window_size"] == (4095, 0)
    assert "--window-attn-skip-freq" not in a  # every layer is local
    q = mapping("model_name=qwen3-8b").megatron_dict()
    assert "--qk-layernorm" in q and "--disable-bias-linear" in q and "--add-qkv-bias" not in q
    q2 = mapping("model_name=qwen2.5-7b")
    assert "--add-qkv-bias" in q2.megatron_dict() and q2.factory == "qwen25_7b" and q2.factory_exact


def test_muon_exports_megatron_cores_muon_settings_or_is_refused_in_one_line():
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    m = mapping("opt_type=muon", "muon_weight_decay=0.1", "muon_beta=0.9")
    a, n = m.megatron_dict(), dict(m.nemo)
    assert a["--optimizer"] == "muon" and a["--muon-momentum"] == 0.9 and a["--muon-scale-mode"] == "shape_scaling"
    assert "--muon-use-nesterov" in a and a["--weight-decay"] == 0.1
    fields = {k.split(".")[-1] for k in n if k.startswith("recipe.optim.config.muon")}
    assert fields and fields <= set(OptimizerConfig.__dataclass_fields__)  # megatron-core's own names
    rms = mapping("opt_type=muon", "muon_weight_decay=0.1", "muon_consistent_rms=0.2").megatron_dict()
    assert (rms["--muon-scale-mode"], rms["--muon-extra-scale-factor"]) == ("spectral", 0.2)
    with pytest.raises(C.ConfigError, match="muon_weight_decay=0 differs from adam_weight_decay=0.1") as e:
        nemo.map_recipe(C.load(["base.yml", "opt_type=muon"]))
    assert "\n" not in str(e.value)

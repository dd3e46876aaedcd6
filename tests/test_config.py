import re
import subprocess
import sys

import pytest

from maxlite import config as C


def test_defaults_and_overrides_are_typed():
    c = C.load(["base.yml", "model_name=tiny", "steps=7", "learning_rate=1e-3", "scan_layers=false"])
    assert (c.steps, c.learning_rate, c.scan_layers) == (7, 1e-3, False)
    assert c.base_emb_dim == 256  # from the tiny preset
    with pytest.raises(dataclasses_error()):
        c.steps = 3  # frozen


def dataclasses_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


def test_user_yaml_chains_to_base_and_cli_wins(tmp_path):
    (tmp_path / "mine.yml").write_text("base_config: base.yml\nmodel_name: tiny\nsteps: 11\nlog_period: 5\n")
    c = C.load([str(tmp_path / "mine.yml"), "steps=12"])
    assert (c.model_name, c.steps, c.log_period, c.base_emb_dim) == ("tiny", 12, 5, 256)


def test_user_yaml_overrides_preset(tmp_path):
    (tmp_path / "wide.yml").write_text("base_config: base.yml\nmodel_name: tiny\nbase_emb_dim: 512\n")
    assert C.load([str(tmp_path / "wide.yml")]).base_emb_dim == 512


@pytest.mark.parametrize("argv, message", [
    (["base.yml", "stepz=3"], "unknown config key 'stepz' in command line (did you mean 'steps'?)"),
    (["base.yml", "steps=abc"], "steps: expected int, got str 'abc'"),
    (["base.yml", "scan_layers=maybe"], "scan_layers: expected bool"),
    (["base.yml", "model_name=llama9"], "unknown model_name 'llama9'"),
    (["base.yml", "dtype=float8"], "dtype='float8': choose one of float32, bfloat16"),
    (["base.yml", "ici_fsdp_parallelism=-1", "ici_tensor_parallelism=-1"], "only one ici_*_parallelism may be -1"),
    (["nosuch.yml"], "config file 'nosuch.yml' not found"),
    (["base.yml", "spike_factor=0.5"], "spike_factor=0.5: a spike is a loss above this × the recent median"),
])
def test_user_mistakes_are_one_line(argv, message):
    with pytest.raises(C.ConfigError) as e:
        C.load(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_preset_extends_the_preset_its_base_config_names():
    import yaml

    text = yaml.safe_load((C.CONFIG_DIR / "models" / "gemma3-4b.yml").read_text())
    cfg = C.load(["base.yml", "model_name=gemma3-4b-vision"])
    text_only = C.load(["base.yml", "model_name=gemma3-4b"])
    assert {k: getattr(cfg, k) for k in text} == {k: getattr(text_only, k) for k in text}
    assert (cfg.vision_encoder, cfg.vision_image_size, cfg.decoder_block) == ("siglip", 896, "gemma3")
    assert C.load(["base.yml", "model_name=gemma3-4b-vision", "vision_encoder="]).vision_encoder == ""


def test_a_preset_chain_that_loops_names_no_preset_or_is_empty_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "a.yml").write_text("base_config: b.yml\n")
    (tmp_path / "b.yml").write_text("base_config: a.yml\n")
    (tmp_path / "c.yml").write_text("base_config: nowhere.yml\n")
    (tmp_path / "empty.yml").write_text("# nothing yet\n")
    with pytest.raises(C.ConfigError, match=r"empty.yml: the preset sets no key$"):
        C._preset_chain(tmp_path / "empty.yml")
    with pytest.raises(C.ConfigError, match="loops back on itself"):
        C._preset_chain(tmp_path / "a.yml")
    monkeypatch.chdir(tmp_path)  # a file of that name in the working directory is not a preset
    (tmp_path / "gemma3-4b.yml").write_text("base_emb_dim: 8\n")
    with pytest.raises(C.ConfigError, match="base_config 'nowhere.yml' is not a preset beside it"):
        C._preset_chain(tmp_path / "c.yml")
    assert C.load(["base.yml", "model_name=gemma3-4b-vision"]).base_emb_dim == 2560


def test_unknown_key_in_yaml_names_file(tmp_path):
    (tmp_path / "bad.yml").write_text("base_config: base.yml\nlearning_rat: 0.1\n")
    with pytest.raises(C.ConfigError, match="learning_rat.*bad.yml.*did you mean 'learning_rate'"):
        C.load([str(tmp_path / "bad.yml")])


def test_resolve_fills_minus_one_and_checks_products():
    c = C.resolve(C.load(["base.yml", "model_name=tiny", "ici_tensor_parallelism=2"]), 8)
    assert [c.axis_size(a) for a in ("data", "fsdp", "context", "tensor")] == [1, 4, 1, 2]
    assert c.num_devices == 8
    assert c.global_batch_size == 16 and c.tokens_per_step == 16 * c.max_target_length
    with pytest.raises(C.ConfigError, match=r"parallelism product 6 .* != 8 devices"):
        C.resolve(C.load(["base.yml", "model_name=tiny", "ici_fsdp_parallelism=3",
                          "ici_tensor_parallelism=2"]), 8)
    with pytest.raises(C.ConfigError, match="cannot be split"):
        C.resolve(C.load(["base.yml", "model_name=tiny", "ici_tensor_parallelism=3"]), 8)


def test_resolve_multislice_fills_dcn():
    c = C.resolve(C.load(["base.yml", "model_name=tiny"]), 16, num_slices=2)
    assert {a: n for a, n in zip(C.MESH_AXES, c.parallelism("dcn")) if n != 1} == {"data": 2}
    assert {a: n for a, n in zip(C.MESH_AXES, c.parallelism("ici")) if n != 1} == {"fsdp": 8}
    assert c.axis_size("data") == 2 and c.axis_size("fsdp") == 8


def test_batch_divisibility_errors():
    with pytest.raises(C.ConfigError, match="data×fsdp = 8 batch shards 0.5 sequences, not a whole number.*"
                                            "e.g. ici_context_parallelism=2"):
        C.resolve(C.load(["base.yml", "model_name=tiny", "per_device_batch_size=0.5"]), 8)
    with pytest.raises(C.ConfigError, match="not a whole number"):
        C.resolve(C.load(["base.yml", "model_name=tiny", "per_device_batch_size=0.3"]), 8)
    with pytest.raises(C.ConfigError, match="batch shards 1.5 sequences"):
        C.resolve(C.load(["base.yml", "model_name=tiny", "per_device_batch_size=1.5", "ici_fsdp_parallelism=2",
                          "ici_data_parallelism=4"]), 8)
    # tensor=4 over processes of 2 devices: each pair of processes reads the same row of the 2
    # (maxlite/mesh.py readers); an alignment objective assembles its own rows and is refused
    c = C.resolve(C.load(["base.yml", "per_device_batch_size=0.25", "ici_fsdp_parallelism=2",
                          "ici_tensor_parallelism=4"]), 8, num_processes=4)
    assert c.global_batch_size == 2
    with pytest.raises(C.ConfigError, match="only train_objective=lm reads rows that way"):
        C.resolve(C.load(["base.yml", "per_device_batch_size=0.25", "ici_fsdp_parallelism=2",
                          "ici_tensor_parallelism=4", "train_objective=dpo",
                          "dataset_type=preference"]), 8, num_processes=4)
    c = C.resolve(C.load(["base.yml", "model_name=tiny", "per_device_batch_size=0.5",
                          "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]), 8)
    assert c.global_batch_size == 4


def test_tensor_parallel_must_divide_heads():
    with pytest.raises(C.ConfigError, match="base_num_kv_heads=2 is not divisible by tensor parallelism 4"):
        C.resolve(C.load(["base.yml", "model_name=tiny", "ici_tensor_parallelism=4"]), 8)


def test_every_base_key_has_a_comment():
    for line in C.BASE_YML.read_text().splitlines():
        if line and not line.startswith("#") and ":" in line:
            assert "#" in line.split(":", 1)[1], f"base.yml key without a comment: {line}"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "maxlite.train", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_unknown_key_exits_2_with_one_line():
    r = _cli("base.yml", "model_name=tiny", "stepz=3")
    assert r.returncode == 2
    assert r.stderr.strip() == ("maxlite: error: unknown config key 'stepz' in command line "
                                "(did you mean 'steps'?)")


def test_cli_model_too_big_for_host_exits_2_with_one_line(run_dir):
    r = _cli("base.yml", "model_name=llama3.1-405b", "steps=1", f"base_output_directory={run_dir}")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "405.85B params" in lines[0] and "GiB" in lines[0] and "maxlite.plan" in lines[0]


def test_fit_check_on_cpu_counts_the_copy_an_async_checkpoint_makes(monkeypatch):
    import dataclasses

    import jax
    from maxlite import hostmem, mesh as mesh_lib, optim, state as state_lib

    cfg = C.resolve(C.load(["base.yml", "model_name=tiny"]), 1)
    _, abstract, _ = state_lib.abstract_state(cfg, mesh_lib.make_mesh(cfg, jax.devices()[:1]),
                                              optim.make_optimizer(cfg))
    alone = state_lib.nbytes(abstract) + state_lib.nbytes(abstract.params)  # state + gradients
    room = hostmem.Memory(int(alone * 1.5), int(alone * 1.5), "host")  # not for a 2nd state
    monkeypatch.setattr(state_lib.hostmem, "memory", lambda: room)
    with pytest.raises(C.ConfigError, match="plus its copy while an async checkpoint is written"):
        state_lib.check_fits(cfg, abstract)
    state_lib.check_fits(dataclasses.replace(cfg, async_checkpointing=False), abstract)
    state_lib.check_fits(dataclasses.replace(cfg, enable_checkpointing=False), abstract)


def test_legal_types_with_nonsense_values_are_refused():
    for arg, message in (("learning_rate=-1", "learning_rate=-1.0 must be >= 0"),
                         ("adam_b2=1.5", "adam_b2=1.5 must be in [0, 1]"),
                         ("adam_eps=0", "adam_eps=0.0 must be positive"),
                         ("checkpoint_period=-5", "checkpoint_period=-5 must be >= 0")):
        with pytest.raises(C.ConfigError, match=re.escape(message)):
            C.load(["base.yml", arg])


def test_a_bad_recipe_fails_before_anything_is_written(tmp_path, capsys):
    from maxlite.train import main

    out = tmp_path / "runs"
    assert main(["base.yml", "model_name=tiny", "dataset_type=txt", f"base_output_directory={out}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "maxlite: error: dataset_type='txt': choose one of synthetic, text, indexed, sft, preference, prompts"]
    assert not out.exists()


def test_every_entry_point_ends_a_user_error_with_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """maxlite/cli.py: the same error tail for every command (a bad recipe, a missing path)."""
    import importlib

    monkeypatch.setenv("MAXLITE_HOME", str(tmp_path / "home"))
    bad_model = ["base.yml", "model_name=nope"]
    missing = str(tmp_path / "missing")
    calls = [("maxlite.train", bad_model), ("ray_entry.train", bad_model),
             ("maxlite.plan.__main__", [*bad_model, "--topology", "v6e:2x2"]),
             ("maxlite.bridge.nemo", bad_model), ("maxlite.bridge.hf", ["import", missing, missing + "2"]),
             ("maxlite.checkpoints", ["list", missing]), ("maxlite.status", [missing]),
             ("maxlite.launch.__main__", ["status", "no-such-experiment"]),
             ("maxlite.data.preprocess", ["--input", missing, "--output-prefix", missing, "--workers", "0"]),
             ("maxlite.data.tokenizer", ["info", missing])]
    for module, argv in calls:
        assert importlib.import_module(module).main(argv) == 2, module
        err = capsys.readouterr().err
        assert err.startswith("maxlite: error: ") and err.count("\n") == 1, (module, err)


def test_learning_rate_schedule_steps_fixes_the_schedule_whatever_steps():
    """The schedule's length is learning_rate_schedule_steps (-1: steps): raising `steps` (a resumed
    run extended) leaves the past schedule as it was and trains on at the final rate."""
    from maxlite import optim

    common = ["base.yml", "lr_schedule_type=linear", "learning_rate=1e-3", "learning_rate_final_fraction=0.1",
              "warmup_steps_fraction=0.1"]
    # 2 warm-up steps (10% of 20) up to 1e-3, linear to 1e-4 at step 20, then held
    for extra in (["steps=10"], ["steps=40"], ["steps=20", "learning_rate_schedule_steps=-1"], ["steps=20"]):
        argv = [*common, *extra] + ([] if "steps=20" in extra else ["learning_rate_schedule_steps=20"])
        cfg = C.load(argv)
        schedule = optim.learning_rate_schedule(cfg)
        for step, want in ((0, 0.0), (1, 5e-4), (2, 1e-3), (11, 5.5e-4), (20, 1e-4), (35, 1e-4)):
            assert float(schedule(step)) == pytest.approx(want, rel=1e-5, abs=1e-9), (extra, step)
    with pytest.raises(C.ConfigError, match="learning_rate_schedule_steps=0"):
        C.load(["base.yml", "learning_rate_schedule_steps=0"])


# Recipes every launcher refuses before the run directory exists: one line, exit 2, nothing started.
# `at_launch`: the Slurm launcher can tell on the login node (the rest need the job's devices and
# memory: the job exits 2 there and is not requeued, tests/test_launch_slurm.py).
BAD_RECIPES = [
    (["dataset_type=indexed", "data_prefix=x", "data_split=1,2,x"], "expected three numbers", True),
    (["dataset_type=text", "data_split=1,2,x"], "data_split is read by dataset_type=indexed", True),
    (["max_time=2h"], "D:HH:MM:SS", True),
    (["preemption_signals=SIGFOO"], "not a catchable preemption signal", True),
    (["checkpoint_dir=s3://bucket/ckpt"], "local paths or gs:// only", True),
    (["ray_use_tpu=true"], "needs tpu_topology", True),
    (["fault_type=crash"], "needs fault_step", True),
    (["train_objective=grpo", "dataset_type=prompts", "reward_functions=[nope]"], "package.module:function", True),
    (["dataset_type=text", "dataset_path=/nonexistent/x.jsonl", "eval_interval=0"], "not found", True),
    (["dataset_type=text", "vocab_size=1000"], "has 4096 ids but vocab_size=1000", True),
    (["ici_tensor_parallelism=3"], "ici (within a slice)", False),
    (["model_name=llama3.1-405b", "vocab_size=128256"], "GiB", False),  # the host's memory
    (["base_output_directory={tmp}/A_FILE/runs"], "A_FILE is a file, not a directory", False),  # the job's disk
]


@pytest.fixture
def own_signals():
    """main() installs the run's signal handlers in this process: give pytest its own back."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("keys, words, at_launch", BAD_RECIPES, ids=[r[1][:24] for r in BAD_RECIPES])
def test_every_launcher_refuses_a_bad_recipe_before_the_run_directory(tmp_path, capsys, monkeypatch, own_signals,
                                                                       keys, words, at_launch):
    from maxlite.launch import __main__ as launch
    from ray_entry import train as ray_entry
    from maxlite.train import main

    monkeypatch.setenv("MAXLITE_HOME", str(tmp_path / "home"))
    out = tmp_path / "runs"
    (tmp_path / "A_FILE").write_text("a regular file where a directory would go")
    argv = ["base.yml", "model_name=tiny", f"base_output_directory={out}", "run_name=r",
            *(k.format(tmp=tmp_path) for k in keys)]
    for name, call, want in (
            ("maxlite.train", lambda: main(argv), 2),
            ("ray_entry.train", lambda: ray_entry.main(argv), 2),  # refused before any Ray cluster starts
            ("slurm", lambda: launch.main(["slurm", *argv, "--partition", "debug", "--experiment-name", "e",
                                           "--dry-run"]), 2 if at_launch else 0)):
        assert call() == want, name
        err = capsys.readouterr().err
        if want:
            assert err.count("\n") == 1 and err.startswith("maxlite: error: ") and words in err, (name, err)
        assert not out.exists(), name
    assert at_launch == (not (tmp_path / "home" / "experiments" / "e").exists())


def test_every_key_of_base_yml_is_read_by_code():
    """A key nothing reads is a defect: each key of the schema (base.yml) is read outside the modules
    that declare, load and check keys (as `cfg.key` or `self.key`, or by name), or built from a name
    table whose code reads it (the splash block sizes, the mesh axes)."""
    import pathlib

    from maxlite import schema
    from maxlite.models import attention

    root = pathlib.Path(C.__file__).parent
    texts = [p.read_text() for p in [*root.rglob("*.py"), *(root.parent / "ray_entry").rglob("*.py")]
             if p.name not in ("config.py", "config_checks.py", "schema.py", "schema_model.py", "schema_alignment.py")]
    # (declaring, checking: not reading)
    by_table = {f"sa_{k}" for k in attention._SPLASH_KEYS} | {
        C.parallelism_key(p, axis) for p in ("ici", "dcn") for axis in C.MESH_AXES}
    unread = [k for k in schema.FIELDS if k not in by_table
              and not any(re.search(rf"\.{k}\b|[\"']{k}[\"']", t) for t in texts)]
    assert unread == []


@pytest.mark.parametrize("argv, devices, message", [
    (["model_name=tiny", "num_experts=8"], 1, "decoder_block=llama2 has a dense MLP"),
    (["model_name=tiny", "mlp_bias=true"], 1, "decoder_block=llama2 has a dense MLP"),
    (["model_name=tiny-moe", "mlp_activations_limit=7"], 1, "clamps gpt-oss's and DeepSeek-V4's SwiGLU"),
    (["model_name=tiny-moe", "num_experts_per_tok=9"], 1, r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
    (["model_name=tiny-moe", "moe_implementation=capacity"], 1, "set capacity_factor > 0"),
    (["model_name=tiny-moe", "interleave_moe_layer_step=3"], 1, "must divide the 4 layers"),
    (["model_name=tiny-moe", "num_experts=6", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2"], 8,
     "num_experts=6 must be a multiple of it"),
    (["model_name=tiny", "ici_expert_parallelism=2"], 2, "a dense model has none"),
    (["model_name=tiny-moe", "lora_rank=4"], 1, "adapts the attention projections"),
    (["model_name=tiny-moe", "ici_expert_parallelism=2", "ici_context_parallelism=2"], 4,
     "context parallelism 2 with expert parallelism 2 is not supported yet"),
])
def test_mixture_of_experts_mistakes_are_one_line(argv, devices, message):
    with pytest.raises(C.ConfigError, match=message):
        C.resolve(C.load(["base.yml", *argv]), devices)


def test_expert_parallelism_splits_the_batch_and_resolves_the_implementation():
    c = C.resolve(C.load(["base.yml", "model_name=tiny-moe", "ici_expert_parallelism=4"]), 8, platform="cpu")
    assert (c.axis_size("fsdp"), c.axis_size("expert"), c.num_devices) == (2, 4, 8) and c.moe_implementation == "blocked"
    assert C.resolve(C.load(["base.yml", "model_name=tiny-moe"]), 1, platform="gpu").moe_implementation == "ragged"
    assert C.resolve(C.load(["base.yml", "model_name=tiny-moe", "capacity_factor=1.25"]), 1,
                     platform="tpu").moe_implementation == "capacity"

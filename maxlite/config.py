"""base.yml + models/<model_name>.yml + your YAML + key=value → one frozen, typed Config.

The keys, their defaults and their types come from `configs/base.yml` (the single source of
truth); a key's type is its default's type. This module imports no JAX: anything that needs the
device count (`-1` parallelism, batch divisibility) happens in `resolve()`, which the caller feeds
with the count it measured.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import pathlib
import re
import signal
from typing import Any, Sequence

import yaml

from maxlite.models import names

CONFIG_DIR = pathlib.Path(__file__).parent / "configs"
BASE_YML = CONFIG_DIR / "base.yml"
MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")  # order of the device mesh axes
_SPECIAL_KEYS = ("base_config",)  # allowed in YAML files, not part of Config


class ConfigError(ValueError):
    """A user mistake in the recipe: printed as one line, exit code 2."""


def _read_yaml(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of key: value")
    return data


def _find_yaml(name: str, relative_to: pathlib.Path | None = None) -> pathlib.Path:
    """A file of that name if it exists (cwd, then beside the including file), else the packaged one."""
    for candidate in (pathlib.Path(name), (relative_to.parent / name) if relative_to else None):
        if candidate is not None and candidate.is_file():
            return candidate
    packaged = CONFIG_DIR / pathlib.Path(name).name
    if packaged.is_file():
        return packaged
    raise ConfigError(f"config file '{name}' not found (nor packaged in {CONFIG_DIR})")


def _load_chain(path: pathlib.Path, seen: tuple[pathlib.Path, ...] = ()) -> dict[str, Any]:
    """A YAML file merged over its `base_config:` chain (the packaged base.yml is implied)."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: base_config chain loops back on itself")
    if path.resolve() == BASE_YML.resolve():
        return {}  # the defaults: applied first anyway, and must not mask the model preset
    data = _read_yaml(path)
    parent = data.pop("base_config", None)
    if parent is None:
        return data
    merged = _load_chain(_find_yaml(str(parent), path), seen + (path.resolve(),))
    merged.update(data)
    return merged


_DEFAULTS: dict[str, Any] = _read_yaml(BASE_YML)


def _field_type(default: Any) -> type:
    return type(default) if default is not None else str


class _ConfigMethods:
    """Derived values. All parallelism keys are concrete after `resolve()`."""

    def parallelism(self, prefix: str) -> tuple[int, ...]:
        return tuple(getattr(self, f"{prefix}_{axis}_parallelism") for axis in MESH_AXES)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Global mesh shape over MESH_AXES: ici × dcn per axis."""
        return tuple(i * d for i, d in zip(self.parallelism("ici"), self.parallelism("dcn")))

    def axis_size(self, axis: str) -> int:
        """The global size of one mesh axis (MESH_AXES)."""
        return self.mesh_shape[MESH_AXES.index(axis)]

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def micro_batch_size(self) -> int:
        """Global sequences per micro-batch."""
        return round(self.per_device_batch_size * self.num_devices)

    @property
    def global_batch_size(self) -> int:
        """Global sequences per optimizer step."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.max_target_length

    @property
    def schedule_steps(self) -> int:
        """The learning-rate schedule's length: learning_rate_schedule_steps, or `steps` (-1)."""
        return self.steps if self.learning_rate_schedule_steps == -1 else self.learning_rate_schedule_steps

    @property
    def warmup_steps(self) -> int:
        if self.lr_warmup_steps >= 0:
            return self.lr_warmup_steps
        return int(self.warmup_steps_fraction * self.schedule_steps)

    @property
    def wsd_decay_steps(self) -> int:
        """lr_schedule_type=wsd: the decay's length, at the schedule's end."""
        return int(self.wsd_decay_steps_fraction * self.schedule_steps)

    @property
    def run_dir(self) -> str:
        return f"{self.base_output_directory.rstrip('/')}/{self.run_name}"

    @property
    def ray_workers(self) -> int:
        """Ray Train workers = hosts. TPU: hosts per slice (topology chips / chips per host) × slices;
        else ray_num_workers (-1: 2). One-line errors for a topology that does not say it."""
        if not self.ray_use_tpu:
            return 2 if self.ray_num_workers == -1 else self.ray_num_workers
        if not self.tpu_topology or not self.tpu_accelerator_type:
            raise ConfigError("ray_use_tpu=true needs tpu_topology (e.g. 4x4) and "
                              "tpu_accelerator_type (e.g. TPU-V6E)")
        try:
            chips = math.prod(int(d) for d in self.tpu_topology.lower().split("x"))
        except ValueError:
            raise ConfigError(f"tpu_topology={self.tpu_topology!r}: write it as AxB or AxBxC, e.g. 4x4") from None
        if self.tpu_chips_per_host < 1 or chips % self.tpu_chips_per_host:
            raise ConfigError(f"tpu_topology={self.tpu_topology} has {chips} chips, not a multiple of "
                              f"tpu_chips_per_host={self.tpu_chips_per_host}")
        slices = self.num_slices if self.num_slices > 0 else 1
        hosts = chips // self.tpu_chips_per_host * slices
        if self.ray_num_workers not in (-1, hosts):
            raise ConfigError(
                f"ray_num_workers={self.ray_num_workers}, but {slices} slice(s) of {self.tpu_topology} "
                f"with {self.tpu_chips_per_host} chips per host have {hosts} hosts; set it to {hosts} or -1")
        return hosts

    def blend(self, key: str = "data_prefix") -> list[tuple[float, str]]:
        """(weight, prefix) pairs of a blend key, the weights summing to 1 ([] when unset)."""
        pairs = list(zip(getattr(self, key)[::2], getattr(self, key)[1::2]))
        total = sum(w for w, _ in pairs)
        return [(w / total, p) for w, p in pairs]

    @property
    def split_fractions(self) -> tuple[float, float, float]:
        """data_split as (train, valid, test) fractions."""
        return parse_split(self.data_split)

    @property
    def max_time_seconds(self) -> float | None:
        return parse_max_time(self.max_time)

    @property
    def preemption_signal_numbers(self) -> list[signal.Signals]:
        return parse_signals(self.preemption_signals)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


Config = dataclasses.make_dataclass(
    "Config",
    [(k, _field_type(v), dataclasses.field(default=tuple(v) if isinstance(v, list) else v))
     for k, v in _DEFAULTS.items()],
    bases=(_ConfigMethods,),
    frozen=True,
)
Config.__module__ = __name__
Config.__doc__ = "Every key of configs/base.yml, typed by its default; frozen."


def _coerce(key: str, value: Any, from_cli: bool) -> Any:
    """Value → the key's type, or a one-line error."""
    if key in BLEND_KEYS:
        return parse_blend(value, key)
    want = _field_type(_DEFAULTS[key])
    if from_cli and want is not str:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{key}={value!r}: cannot parse as {want.__name__}") from None
    if want is float and isinstance(value, str):
        try:
            value = float(value)  # YAML 1.1 reads 1e-4 as a string
        except ValueError:
            pass
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if want is str and value is None:
        value = ""
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if want is list and isinstance(value, str) and not value.strip():
        value = []
    if want is list and isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(
            f"{key}: expected {want.__name__}, got {type(value).__name__} {value!r}"
        )
    return tuple(value) if want is list else value


def _check_keys(updates: dict[str, Any], where: str) -> None:
    for key in updates:
        if key in _DEFAULTS or key in _SPECIAL_KEYS:
            continue
        close = difflib.get_close_matches(key, list(_DEFAULTS), n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown config key '{key}' in {where}{hint}")


def parse_cli(argv: Sequence[str]) -> tuple[str | None, dict[str, str]]:
    """`[file.yml] key=value ...` → (yaml path or None, overrides as raw strings)."""
    path, overrides = None, {}
    for i, arg in enumerate(argv):
        if "=" in arg:
            key, value = arg.split("=", 1)
            overrides[key.strip().lstrip("-")] = value
        elif i == 0 and arg.endswith((".yml", ".yaml")):
            path = arg
        else:
            raise ConfigError(f"unexpected argument '{arg}': use a YAML file first, then key=value")
    return path, overrides


def user_keys(argv: Sequence[str]) -> set[str]:
    """The keys a user set in `[file.yml] key=value ...` (the YAML's base_config chain included)."""
    path, cli = parse_cli(argv)
    chain = _load_chain(_find_yaml(path)) if path is not None else {}
    return (set(chain) | set(cli)) - set(_SPECIAL_KEYS)


def load(argv: Sequence[str] = (), **overrides: Any) -> Config:
    """Build a Config from command-line style arguments and keyword overrides (not yet resolved)."""
    path, cli = parse_cli(argv)
    user: dict[str, Any] = {}
    if path is not None:
        yml = _find_yaml(path)
        user = _load_chain(yml)
        _check_keys(user, str(yml))
    _check_keys(cli, "command line")
    _check_keys(overrides, "overrides")
    user.pop("base_config", None)

    model_name = cli.get("model_name", overrides.get("model_name", user.get("model_name", "default")))
    preset: dict[str, Any] = {}
    if model_name != "default":
        preset_path = CONFIG_DIR / "models" / f"{model_name}.yml"
        if not preset_path.is_file():
            names = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yml"))
            close = difflib.get_close_matches(str(model_name), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown model_name '{model_name}'{hint}; presets: {', '.join(names)}")
        preset = _read_yaml(preset_path)
        _check_keys(preset, str(preset_path))

    values = {k: tuple(v) if isinstance(v, list) else v for k, v in _DEFAULTS.items()}
    for layer, from_cli in ((preset, False), (user, False), (overrides, False), (cli, True)):
        for key, value in layer.items():
            values[key] = _coerce(key, value, from_cli)
    if not values["run_name"]:
        values["run_name"] = default_run_name(path, str(model_name))
    _resolve_paths(values)
    config = Config(**values)
    from maxlite import config_checks  # what each value may be (it imports this module)

    config_checks.validate(config)
    return config


def default_run_name(recipe: str | None, model_name: str) -> str:
    """The run directory's name when `run_name` is unset: the recipe's and the model's names
    (`demo_tiny`, `base_llama3.1-8b`), the same on every re-run of the command, so a re-run resumes
    the run (and a higher `steps` extends it); set run_name for a separate run of the same recipe."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", pathlib.Path(recipe).stem) if recipe else "run"
    return stem if model_name in ("default", stem) else f"{stem}_{model_name}"


# Every key that names a file or directory. Each is resolved here, once, so that every part of
# maxlite (the loop, Orbax's background threads, Ray workers, the bridge) sees the same absolute
# path whatever the working directory: Orbax refuses relative paths, and a worker's cwd differs.
PATH_KEYS = ("base_output_directory", "checkpoint_dir", "load_parameters_path", "load_full_state_path",
             "tokenizer_path", "data_cache_dir", "jax_cache_dir", "wandb_dir")
PATH_LIST_KEYS = ("dataset_path", "eval_dataset_path")  # comma-separated files, directories, globs
BLEND_KEYS = ("data_prefix", "eval_data_prefix")  # prefix, [prefix, ...] or [w1, prefix1, ...]


def resolve_path(path: str) -> str:
    """A user's path as maxlite uses it: URLs (gs://...) as given; local paths absolute, `~` expanded.

    Every CLI path argument and Python API entry point goes through this as well."""
    path = str(path).strip()
    if not path or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def parse_blend(spec: Any, key: str = "data_prefix") -> tuple:
    """THE parse of a Megatron data blend — `prefix`, `[prefix, ...]` (equal weights) or
    `[w1, prefix1, w2, prefix2, ...]`, as YAML or as command-line text — into the typed value the
    config holds: (w1, prefix1, w2, prefix2, ...) with float weights and resolved paths."""
    items = spec
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("["):
            try:
                items = yaml.safe_load(text)
            except yaml.YAMLError:
                raise ConfigError(f"{key}={spec!r}: cannot parse; use [w1,prefix1,w2,prefix2]") from None
        else:
            items = text.replace(",", " ").split()
    if not isinstance(items, (list, tuple)):
        items = [items]
    items = [x for x in items if str(x).strip()]
    if not items:
        return ()

    def weight(x) -> float | None:
        if isinstance(x, bool):
            return None
        try:
            return float(x)
        except (TypeError, ValueError):
            return None

    if weight(items[0]) is None:  # prefixes only
        pairs = [(1.0, str(p)) for p in items]
    else:
        if len(items) % 2:
            raise ConfigError(f"{key}: expected weight,prefix pairs, got {len(items)} items")
        pairs = [(weight(w), str(p)) for w, p in zip(items[::2], items[1::2])]
        if any(w is None or w <= 0 for w, _ in pairs):
            raise ConfigError(f"{key}: weights must be positive numbers, got {list(items[::2])}")
    return tuple(x for w, p in pairs for x in (w, resolve_path(p)))


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's data_split '99,1,0' (also '99/1/0'; missing shares are 0) → fractions."""
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"data_split={split!r}: expected three numbers like 99,1,0") from None
    if len(parts) > 3:
        raise ConfigError(f"data_split={split!r}: expected at most three numbers (train,valid,test)")
    parts = (parts + [0.0] * 3)[:3]
    if any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"data_split={split!r}: shares must be non-negative with a positive sum")
    return tuple(p / sum(parts) for p in parts)


def parse_max_time(text: str) -> float | None:
    """max_time `D:HH:MM:SS` (also `HH:MM:SS`, `MM:SS`, `SS`) → seconds; "" → None."""
    text = text.strip()
    if not text:
        return None
    if not re.fullmatch(r"\d+(:\d+){0,3}", text):
        raise ConfigError(f"max_time={text!r}: expected D:HH:MM:SS, e.g. max_time=0:03:50:00")
    seconds = 0
    for value, unit in zip(reversed([int(p) for p in text.split(":")]), (1, 60, 3600, 86400)):
        seconds += value * unit
    if seconds <= 0:
        raise ConfigError(f"max_time={text!r} must be positive (or \"\" for no limit)")
    return float(seconds)


def parse_signals(text: str) -> list[signal.Signals]:
    """preemption_signals `SIGTERM,SIGUSR1` → signals (SIGINT is always the user's stop)."""
    out = []
    for name in filter(None, (s.strip().upper() for s in text.split(","))):
        name = name if name.startswith("SIG") else f"SIG{name}"
        if not hasattr(signal.Signals, name) or name in ("SIGKILL", "SIGSTOP", "SIGINT"):
            raise ConfigError(f"preemption_signals: {name} is not a catchable preemption signal (e.g. "
                              f"SIGTERM,SIGUSR1; SIGINT, Ctrl-C, always stops the run)")
        out.append(signal.Signals[name])
    return out


def _resolve_paths(values: dict[str, Any]) -> None:
    for key in PATH_KEYS:
        values[key] = resolve_path(values[key])
    for key in PATH_LIST_KEYS:
        items = [s.strip() for s in values[key].split(",") if s.strip()]
        values[key] = ",".join(resolve_path(s) for s in items)


OBJECTIVE_DATASET = {"dpo": "preference", "grpo": "prompts"}  # the dataset_type an alignment objective reads
CHAT_DATASETS = ("sft", "preference", "prompts")  # rendered with the chat template (sft_template)
FILE_DATASETS = ("text", *CHAT_DATASETS)  # read from dataset_path / eval_dataset_path files
# Keys only some data sources read: set on a run whose source ignores them, they are refused (a
# setting that silently does nothing is a mistake the user should hear about).
SOURCE_KEYS = {
    "data_prefix": ("indexed",), "eval_data_prefix": ("indexed",), "data_split": ("indexed",),
    "grain_worker_count": ("indexed",), "grain_threads": ("indexed",), "data_cache_dir": ("indexed",),
    "dataset_path": FILE_DATASETS, "eval_dataset_path": FILE_DATASETS, "json_keys": ("text",),
    "add_eos": ("text",), "packing_bins": ("text", "sft"), "data_shuffle_window": FILE_DATASETS,
    "data_bad_record_policy": FILE_DATASETS, "sft_train_on_inputs": ("sft",),
    "sft_allow_degenerate_mask": ("sft",), "sft_audit_records": ("sft",), "sft_audit_examples": ("sft",),
}
STORAGE_SCHEMES = ("gs://",)  # besides local paths: what checkpoints and run directories support

def _fill(values: tuple[int, ...], total: int, what: str) -> tuple[int, ...]:
    known = math.prod(v for v in values if v != -1)
    if -1 in values:
        if total % known:
            raise ConfigError(f"{what}: {total} devices cannot be split by the fixed axes {values}")
        values = tuple(total // known if v == -1 else v for v in values)
    if math.prod(values) != total:
        named = ", ".join(f"{a}={v}" for a, v in zip(MESH_AXES, values))
        raise ConfigError(
            f"{what}: parallelism product {math.prod(values)} ({named}) != {total} devices; "
            f"set one axis to -1 to fill it")
    return values


def resolve(config: Config, num_devices: int, num_slices: int = 1, num_processes: int = 1,
            platform: str | None = None) -> Config:
    """Fill -1 parallelism from the device count and check what needs it; given the devices'
    `platform` (cpu | gpu | tpu), resolve `attention` to the implementation that will run."""
    if config.num_slices not in (-1, num_slices):
        raise ConfigError(f"num_slices={config.num_slices} but the devices form {num_slices} slice(s)")
    if num_devices % num_slices:
        raise ConfigError(f"{num_devices} devices cannot form {num_slices} equal slices")
    dcn = _fill(config.parallelism("dcn"), num_slices, "dcn (across slices)")
    ici = _fill(config.parallelism("ici"), num_devices // num_slices, "ici (within a slice)")
    updates = {f"{p}_{a}_parallelism": v for p, vals in (("ici", ici), ("dcn", dcn))
               for a, v in zip(MESH_AXES, vals)}
    if platform is not None:
        updates["moe_implementation"] = names.resolve_moe(config.moe_implementation, platform,
                                                          config.capacity_factor)
    c = dataclasses.replace(config, num_slices=num_slices, **updates)
    if platform is not None:
        c = dataclasses.replace(c, attention=names.resolve_attention(
            c.attention, platform, c.max_target_length, c.attention_block_size, c.sa_block_q,
            sequence_pieces(c)))

    from maxlite import config_checks  # what the devices' layout needs (it imports this module)

    config_checks.check_layout(c, num_processes)
    return c


def sequence_pieces(c: Config) -> int:
    """The contiguous chunks a sequence is cut into across the context axis: one per shard, or two
    with context_parallel_load_balance (chunks i and 2n−1−i on shard i: maxlite/models/context.py)."""
    context = c.axis_size("context")
    return 2 * context if context > 1 and c.context_parallel_load_balance else context


def to_plain_dict(config: Config) -> dict[str, Any]:
    """Keys → plain YAML/JSON values (tuples as lists): what config.yml and checkpoint meta hold."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.to_dict().items()}


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_plain_dict(config), sort_keys=False)

"""base.yml + models/<model_name>.yml + your YAML + key=value → one frozen, typed Config.

The keys, their types and their defaults are the schema's (maxlite/schema.py, which base.yml is
written from); `Config` adds what follows from them (maxlite/recipe.py); what each value may be is
checked by maxlite/config_checks.py. This module loads and resolves, and imports no JAX: anything
that needs the device count (`-1` parallelism, batch divisibility) happens in `resolve()`, which
the caller feeds with the count it measured.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import pathlib
import re
import typing
from typing import Any, Sequence

import yaml

from maxlite import config_checks, run_identity
from maxlite.models import names
# The names the rest of maxlite reads as `maxlite.config.X` (one home each: schema, recipe).
from maxlite.recipe import (CHAT_DATASETS, Config, parse_blend, parse_max_time,  # noqa: F401
                            parse_signals, parse_split, resolve_path)
from maxlite.schema import BASE_YML, FIELDS, MESH_AXES, ConfigError, keys_of, parallelism_key  # noqa: F401

CONFIG_DIR = BASE_YML.parent
_SPECIAL_KEYS = ("base_config",)  # allowed in YAML files, not part of Config


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


def _preset_chain(path: pathlib.Path, seen: tuple[pathlib.Path, ...] = ()) -> dict[str, Any]:
    """A model preset merged over the preset its `base_config:` names (a file beside it, never one
    in the working directory): `gemma3-4b-vision.yml` is `gemma3-4b.yml` and its vision tower."""
    if path in seen:
        raise ConfigError(f"{path}: base_config chain loops back on itself")
    data = _read_yaml(path)
    if not data:  # a preset that sets nothing would train the default model under its name
        raise ConfigError(f"{path}: the preset sets no key")
    parent = data.pop("base_config", None)
    if parent is None:
        return data
    base = path.parent / str(parent)
    if not base.is_file():
        raise ConfigError(f"{path}: base_config '{parent}' is not a preset beside it")
    return {**_preset_chain(base, seen + (path,)), **data}


def _coerce(key: str, value: Any, from_cli: bool) -> Any:
    """Value → the key's type (the schema's), or a one-line error."""
    if FIELDS[key].metadata["kind"] == "blend":
        return parse_blend(value, key)
    want = FIELDS[key].type
    if from_cli and want is not str:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{key}={value!r}: cannot parse as {_name(want)}") from None
    if typing.get_origin(want) is tuple:  # a YAML list; each item of the tuple's item type
        if isinstance(value, str) and not value.strip():
            value = []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected list, got {type(value).__name__} {value!r}")
        item = typing.get_args(want)[0]
        return tuple(_scalar(f"{key}[{i}]", x, item) for i, x in enumerate(value))
    return _scalar(key, value, want)


def _scalar(what: str, value: Any, want: type) -> Any:
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
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"{what}: expected {_name(want)}, got {type(value).__name__} {value!r}")
    return value


def _name(want) -> str:
    return "list" if typing.get_origin(want) is tuple else want.__name__


def _check_keys(updates: dict[str, Any], where: str) -> None:
    for key in updates:
        if key in FIELDS or key in _SPECIAL_KEYS:
            continue
        close = difflib.get_close_matches(key, list(FIELDS), n=1, cutoff=0.6)
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
        preset = _preset_chain(preset_path)
        _check_keys(preset, str(preset_path))

    values = {k: f.default for k, f in FIELDS.items()}
    recipe = values
    for layer, from_cli in ((preset, False), (user, False), (overrides, False), (cli, True)):
        if layer is overrides:
            recipe = dict(values)  # the recipe alone: the default run name adds what the command line changes
        for key, value in layer.items():
            values[key] = _coerce(key, value, from_cli)
    if not values["run_name"]:
        values["run_name"] = run_identity.default_run_name(path, str(model_name), recipe, values)
    _resolve_paths(values)
    config = Config(**values)
    config_checks.validate(config)
    return config


# Every key that names a file or directory (schema kind `path`, `paths`: comma-separated files,
# directories, globs) is resolved here, once, so that every part of maxlite (the loop, Orbax's
# background threads, Ray workers, the bridge) sees the same absolute path whatever the working
# directory: Orbax refuses relative paths, and a worker's cwd differs. Blends resolve theirs when
# parsed (parse_blend).
def _resolve_paths(values: dict[str, Any]) -> None:
    for key in keys_of("path"):
        values[key] = resolve_path(values[key])
    for key in keys_of("paths"):
        items = [s.strip() for s in values[key].split(",") if s.strip()]
        values[key] = ",".join(resolve_path(s) for s in items)


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
    `platform` (cpu | gpu | tpu), resolve `attention` and `moe_implementation` to the
    implementations that will run, and check what that platform cannot run."""
    if config.num_slices not in (-1, num_slices):
        raise ConfigError(f"num_slices={config.num_slices} but the devices form {num_slices} slice(s)")
    if num_devices % num_slices:
        raise ConfigError(f"{num_devices} devices cannot form {num_slices} equal slices")
    dcn = _fill(config.parallelism("dcn"), num_slices, "dcn (across slices)")
    ici = _fill(config.parallelism("ici"), num_devices // num_slices, "ici (within a slice)")
    updates = {parallelism_key(p, a): v for p, vals in (("ici", ici), ("dcn", dcn))
               for a, v in zip(MESH_AXES, vals)}
    if platform is not None:
        updates["moe_implementation"] = names.resolve_moe(config.moe_implementation, platform,
                                                          config.capacity_factor)
    c = dataclasses.replace(config, num_slices=num_slices, **updates)
    if platform is not None:
        c = dataclasses.replace(c, attention=names.resolve_attention(
            c.attention, platform, c.max_target_length, c.attention_block_size, c.sa_block_q,
            c.sequence_pieces, c.attention_sink, names.image_blocks(c), c.dtype))
        config_checks.check_platform(c, platform)
    config_checks.check_layout(c, num_processes)
    return c


def to_plain_dict(config: Config) -> dict[str, Any]:
    """Keys → plain YAML/JSON values (tuples as lists): what config.yml and checkpoint meta hold."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.to_dict().items()}


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_plain_dict(config), sort_keys=False)

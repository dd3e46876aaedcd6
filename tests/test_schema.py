"""maxlite/schema.py: the one declaration of every key, and base.yml written from it."""

import dataclasses
import typing

import yaml

from maxlite import base_yml, config as C, schema


def test_base_yml_is_what_the_schema_writes():
    """base.yml is generated: a key added, changed or removed in one and not the other fails here."""
    written = set(yaml.safe_load(schema.BASE_YML.read_text()))
    assert schema.BASE_YML.read_text() == base_yml.render(), (
        f"maxlite/configs/base.yml differs from maxlite/schema.py (keys only in base.yml: "
        f"{sorted(written - set(schema.FIELDS))}, only in the schema: {sorted(set(schema.FIELDS) - written)}): "
        f"declare keys in the schema, then run python -m maxlite.base_yml")


def test_base_yml_reads_back_as_the_defaults():
    """What a user reads in base.yml (and a copy of it loads) is each key's default, of its type."""
    written = yaml.safe_load(schema.BASE_YML.read_text())
    assert list(written) == list(schema.FIELDS)
    for name, f in schema.FIELDS.items():
        default = list(f.default) if isinstance(f.default, tuple) else f.default
        assert written[name] == default and type(written[name]) is type(default), (name, written[name])


def test_every_default_has_its_declared_type_and_one_line_of_doc():
    hints = typing.get_type_hints(C.Config)
    assert set(hints) == set(schema.FIELDS) and dataclasses.is_dataclass(C.Config)
    for name, f in schema.FIELDS.items():
        want = hints[name]
        if typing.get_origin(want) is tuple:
            item = typing.get_args(want)[0]
            assert isinstance(f.default, tuple) and all(isinstance(x, item) for x in f.default), name
        else:
            assert type(f.default) is want, (name, want, f.default)
        assert f.metadata["doc"].strip() and "\n" not in f.metadata["doc"], name


def test_a_list_key_coerces_each_item_to_its_type():
    c = C.load(["base.yml", "model_name=tiny", "reward_weights=[1, 0.5]", "sample_prompts=[12, hi]"])
    assert c.reward_weights == (1.0, 0.5) and c.sample_prompts == ("12", "hi")
    for argv, message in ((["reward_weights=[a]"], "reward_weights[0]: expected float, got str 'a'"),
                          (["loggers=wandb"], "loggers: expected list, got str 'wandb'")):
        try:
            C.load(["base.yml", *argv])
        except C.ConfigError as e:
            assert str(e) == message
        else:
            raise AssertionError(argv)


def test_every_key_naming_a_path_is_resolved(tmp_path, monkeypatch):
    """The schema's `path` and `paths` kinds are what loading resolves (against the working directory)."""
    monkeypatch.chdir(tmp_path)
    paths = [k for k in schema.keys_of("path") if k not in ("load_full_state_path", "data_cache_dir")]
    c = C.load(["base.yml", *(f"{k}=rel" for k in paths), "dataset_path=a,b", "dataset_type=text"])
    assert {k: getattr(c, k) for k in paths} == {k: str(tmp_path / "rel") for k in paths}
    assert c.dataset_path == f"{tmp_path / 'a'},{tmp_path / 'b'}"
    assert (C.load(["base.yml", "load_full_state_path=rel"]).load_full_state_path,
            C.load(["base.yml", "dataset_type=indexed", "data_prefix=p", "data_cache_dir=rel"]).data_cache_dir
            ) == (str(tmp_path / "rel"),) * 2


def test_the_values_each_key_may_take_are_what_loading_enforces():
    """Every choice, bound and `positive` the schema declares refuses what lies outside it, one line each."""
    def refused(key, text):
        try:
            C.load(["base.yml", f"{key}={text}"])
        except C.ConfigError as e:
            return str(e)
        raise AssertionError(f"{key}={text} was accepted")

    checked = 0
    for key, f in schema.FIELDS.items():
        m, cast = f.metadata, schema.FIELDS[key].type
        if m["choices"]:
            text = "[no_such]" if isinstance(f.default, tuple) else "no_such"
            assert refused(key, text).startswith(f"{key}='no_such': choose one of "), key
        if m["positive"]:
            assert refused(key, "0") == f"{key}={cast(0)} must be positive"
        low, high = m["bounds"] or (None, None)
        if low is not None:
            assert refused(key, str(cast(low - 1))).startswith(f"{key}={cast(low - 1)} must be "), key
        if high is not None:
            assert refused(key, str(cast(high + 1))) == f"{key}={cast(high + 1)} must be in [{low}, {high}]"
        checked += bool(m["choices"] or m["positive"] or m["bounds"])
    assert checked > 80

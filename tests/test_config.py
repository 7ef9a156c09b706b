import dataclasses
import math
from pathlib import Path

import pytest
import yaml

from openvc_diffusers.config import ConfigError, OpenVCConfig, format_indices, load_config

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def test_defaults():
    cfg = load_config()
    assert cfg == OpenVCConfig()
    assert cfg.backends == ("openvc", "fa4", "sdpa")
    assert cfg.min_tokens == 1024
    assert cfg.repair_ratio == 0.005 and cfg.repair_ranking == "energy" and cfg.smooth_k
    assert cfg.window == 4
    assert cfg.cross_attention == "sdpa"
    assert cfg.bf16_layers == frozenset() and cfg.bf16_steps == frozenset()
    assert cfg.ulysses_degree == 1 and cfg.ring_degree == 1


def test_default_yaml_is_the_defaults():
    assert load_config(DEFAULT_YAML) == OpenVCConfig()
    assert load_config(str(DEFAULT_YAML)) == OpenVCConfig()


def test_config_and_empty_sources():
    cfg = OpenVCConfig(min_tokens=0)
    assert load_config(cfg) is cfg
    assert load_config({}) == OpenVCConfig()


def test_round_trip():
    cfg = OpenVCConfig(
        backends=("fa4", "sdpa"),
        min_tokens=0,
        repair_ratio=0,
        window=None,
        cross_attention="fa4",
        bf16_layers=[0, "28-29"],
        bf16_steps="0-3",
        ulysses_degree=4,
        ring_degree=2,
    )
    data = cfg.to_dict()
    assert data["bf16_layers"] == [0, 28, 29]
    assert data["parallel"] == {"ulysses_degree": 4, "ring_degree": 2}
    assert load_config(data) == cfg
    assert load_config(yaml.safe_load(yaml.safe_dump(data))) == cfg


@pytest.mark.parametrize(
    "value, expected",
    [
        ([0, 1, "28-29"], {0, 1, 28, 29}),
        (7, {7}),
        ("0-3", {0, 1, 2, 3}),
        ("5-5", {5}),
        ([2, "1-3"], {1, 2, 3}),
        ([], set()),
    ],
)
def test_ranges_expand(value, expected):
    cfg = load_config({"bf16_layers": value, "bf16_steps": value})
    assert cfg.bf16_layers == frozenset(expected)
    assert cfg.bf16_steps == frozenset(expected)


def test_int_accepted_as_float_and_window_null():
    cfg = load_config({"repair_ratio": 0, "window": None})
    assert cfg.repair_ratio == 0.0 and isinstance(cfg.repair_ratio, float)
    assert cfg.window is None


def test_load_from_yaml_file(tmp_path):
    path = tmp_path / "wan.yaml"
    path.write_text(
        "backends: [openvc, sdpa]\n"
        "min_tokens: 4096\n"
        "bf16_layers: [0, '28-29']\n"
        "bf16_steps: 0-1\n"
        "window: null\n"
        "parallel:\n"
        "  ulysses_degree: 2\n"
    )
    cfg = load_config(path)
    assert cfg == OpenVCConfig(
        backends=("openvc", "sdpa"),
        min_tokens=4096,
        bf16_layers=frozenset({0, 28, 29}),
        bf16_steps=frozenset({0, 1}),
        window=None,
        ulysses_degree=2,
    )


def test_empty_yaml_file_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert load_config(path) == OpenVCConfig()


def _error(data) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data)
    return str(info.value)


def test_unknown_top_level_key_suggests():
    msg = _error({"min_token": 10})
    assert "'min_token'" in msg and "'min_tokens'" in msg


def test_nested_key_at_top_level_suggests_dotted_name():
    msg = _error({"ulysses_degree": 2})
    assert "'ulysses_degree'" in msg and "'parallel.ulysses_degree'" in msg


def test_unknown_parallel_key():
    msg = _error({"parallel": {"ulysses_degre": 2}})
    assert "'parallel.ulysses_degre'" in msg and "'parallel.ulysses_degree'" in msg


def test_parallel_not_a_mapping():
    msg = _error({"parallel": 2})
    assert "parallel" in msg and "2" in msg


@pytest.mark.parametrize(
    "data, key, bad",
    [
        ({"min_tokens": True}, "min_tokens", "True"),
        ({"window": False}, "window", "False"),
        ({"parallel": {"ulysses_degree": True}}, "parallel.ulysses_degree", "True"),
        ({"repair_ratio": True}, "repair_ratio", "True"),
        ({"bf16_layers": [True]}, "bf16_layers", "True"),
        ({"min_tokens": "1024"}, "min_tokens", "'1024'"),
        ({"min_tokens": 1024.0}, "min_tokens", "1024.0"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"repair_ratio": math.nan}, "repair_ratio", "nan"),
        ({"repair_ratio": math.inf}, "repair_ratio", "inf"),
        ({"repair_ratio": 0.6}, "repair_ratio", "0.6"),
        ({"repair_ratio": -0.1}, "repair_ratio", "-0.1"),
        ({"repair_ratio": "0.005"}, "repair_ratio", "'0.005'"),
        ({"window": -1}, "window", "-1"),
        ({"parallel": {"ulysses_degree": 0}}, "parallel.ulysses_degree", "0"),
        ({"parallel": {"ring_degree": 0}}, "parallel.ring_degree", "0"),
        ({"parallel": {"ring_degree": 2.0}}, "parallel.ring_degree", "2.0"),
        ({"backends": ["openvc", "flash", "sdpa"]}, "backends", "'flash'"),
        ({"backends": ["sdpa", "fa4", "sdpa"]}, "backends", "['sdpa', 'fa4', 'sdpa']"),
        ({"backends": ["openvc", "fa4"]}, "backends", "['openvc', 'fa4']"),
        ({"backends": ["sdpa", "openvc"]}, "backends", "['sdpa', 'openvc']"),
        ({"backends": []}, "backends", "[]"),
        ({"backends": "sdpa"}, "backends", "'sdpa'"),
        ({"cross_attention": "flash"}, "cross_attention", "'flash'"),
        ({"bf16_layers": [0, "5-3"]}, "bf16_layers", "'5-3'"),
        ({"bf16_steps": "x-y"}, "bf16_steps", "'x-y'"),
        ({"bf16_steps": [-1]}, "bf16_steps", "-1"),
        ({"bf16_steps": None}, "bf16_steps", "None"),
        # A range is expanded into a set: unbounded, "0-1000000000" took all memory and the process was killed.
        ({"bf16_layers": "0-1000000000"}, "bf16_layers", "'0-1000000000'"),
        ({"bf16_steps": [10_000]}, "bf16_steps", "10000"),
    ],
)
def test_bad_values_name_key_and_value(data, key, bad):
    msg = _error(data)
    assert msg.startswith(f"{key}: got {bad};")
    assert "expected" in msg


def test_a_number_read_as_text_says_why(tmp_path):
    path = tmp_path / "exponent.yaml"
    path.write_text("repair_ratio: 1e-2\n")  # YAML 1.1: no dot, so a string
    hint = "(this number was read as text: write it unquoted, with a dot before any exponent, e.g. 1.0e-2 or 0.01)"
    assert _error(str(path)).endswith(hint)
    path.write_text("repair_ratio: 1.0e-2\n")
    assert load_config(str(path)).repair_ratio == 0.01
    assert _error({"min_tokens": "1024"}).endswith(hint)
    assert not _error({"repair_ranking": "fast"}).endswith(hint)
    assert not _error({"repair_ranking": "nan"}).endswith(hint)


def test_a_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("min_tokens: 0\nwindow: 2\nmin_tokens: 4096\n")
    message = _error(str(path))
    assert "is not valid YAML" in message and "key 'min_tokens' is given twice; keep one" in message
    assert "line 3" in message
    path.write_text("parallel:\n  ring_degree: 2\n  ring_degree: 1\n")
    assert "key 'ring_degree' is given twice" in _error(str(path))
    # A merge key is not a key given twice, nor is a key that overrides a merged one.
    path.write_text("parallel:\n  <<: {ring_degree: 2, ulysses_degree: 1}\n  ulysses_degree: 2\n")
    assert load_config(str(path)) == OpenVCConfig(ring_degree=2, ulysses_degree=2)
    path.write_text("? [a, b]\n: 1\n")  # an unhashable key: YAML's own error, as a ConfigError
    assert "is not valid YAML" in _error(str(path)) and "unhashable" in _error(str(path))


def test_missing_sdpa_says_why():
    assert "runs everywhere" in _error({"backends": ["openvc"]})
    assert "'sdpa' last: it takes every call" in _error({"backends": ["openvc", "sdpa", "fa4"]})


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    msg = _error(path)
    assert str(path) in msg


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", "42\n"])
def test_yaml_not_a_mapping(tmp_path, text):
    path = tmp_path / "list.yaml"
    path.write_text(text)
    msg = _error(path)
    assert str(path) in msg and "mapping" in msg


def test_invalid_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("backends: [openvc\n")
    assert str(path) in _error(path)


def test_replace_validates_and_normalises():
    cfg = OpenVCConfig()
    with pytest.raises(ConfigError, match="min_tokens: got -1"):
        dataclasses.replace(cfg, min_tokens=-1)
    with pytest.raises(ConfigError, match="parallel.ulysses_degree: got 0"):
        dataclasses.replace(cfg, ulysses_degree=0)
    new = dataclasses.replace(cfg, backends=["fa4", "sdpa"], bf16_layers=[0, "2-3"])
    assert new.backends == ("fa4", "sdpa")
    assert new.bf16_layers == frozenset({0, 2, 3})
    hash(new)  # frozen and fully normalised, so usable as a dict key


def test_wrong_source_type():
    with pytest.raises(TypeError):
        load_config(42)


def test_openvc_config_names_the_default_file(tmp_path, monkeypatch):
    path = tmp_path / "policy.yaml"
    path.write_text("min_tokens: 7\n")
    monkeypatch.setenv("OPENVC_CONFIG", str(path))
    assert load_config().min_tokens == 7
    monkeypatch.setenv("OPENVC_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config()


@pytest.mark.parametrize("name", ["default", "quality", "speed", "ulysses2", "ulysses4", "ulysses8"])
def test_shipped_configs_load(name):
    config = load_config(Path(__file__).parents[1] / "configs" / f"{name}.yaml")
    if name.startswith("ulysses"):
        assert config.ulysses_degree == int(name.removeprefix("ulysses"))


@pytest.mark.parametrize("value", [1, "yes", None])
def test_smooth_k_takes_a_bool(value):
    with pytest.raises(ConfigError, match=f"smooth_k: got {value!r}; expected true or false"):
        load_config({"smooth_k": value})


def test_repair_ranking_is_checked():
    assert load_config({"repair_ranking": "energy"}).repair_ranking == "energy"
    with pytest.raises(ConfigError, match="repair_ranking: got 'mass'; expected one of 'attention', 'energy'"):
        load_config({"repair_ranking": "mass"})


def test_kernel_options_are_the_configs_values_as_kernel_and_reference_keywords():
    import inspect

    import openvc_kernels

    config = load_config({"window": None, "smooth_k": False, "repair_ratio": 0.01, "repair_ranking": "attention"})
    assert config.kernel_options == {
        "window": None, "smooth_k": False, "repair_ratio": 0.01, "repair_ranking": "attention"
    }
    for fn in (openvc_kernels.attention, openvc_kernels.reference_attention):
        parameters = inspect.signature(fn).parameters
        assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in config.kernel_options)


def test_index_bounds_are_named():
    assert "ints in [0, 9999] or inclusive ranges 'a-b' with a <= b <= 9999" in _error({"bf16_layers": "5-10000"})
    assert load_config({"bf16_steps": "9998-9999"}).bf16_steps == frozenset({9998, 9999})


@pytest.mark.parametrize(
    ("indices", "text"), [([0], "0"), ([3, 1, 2, 7], "1-3, 7"), ([0, 28, 29, 30, 40], "0, 28-30, 40")]
)
def test_format_indices_writes_runs_as_ranges(indices, text):
    assert format_indices(indices) == text
    items = [int(item) if item.isdigit() else item for item in text.split(", ")]
    assert load_config({"bf16_layers": items}).bf16_layers == frozenset(indices)

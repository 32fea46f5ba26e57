import dataclasses

import pytest

from tmax_jax.config import override, parse_dotted, to_dict
from tmax_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Inner:
    lr: float = 1e-6
    steps: int = 10
    name: str = "x"


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner = Inner()
    flag: bool = False
    sizes: tuple[int, ...] = (1, 2)
    maybe: int | None = None


def test_override_nested_and_types():
    cfg = override(Outer(), {"inner": {"lr": "3e-4", "steps": 5}, "flag": True, "sizes": [4, 8], "maybe": 3})
    assert cfg.inner == Inner(lr=3e-4, steps=5, name="x")
    assert cfg.flag is True and cfg.sizes == (4, 8) and cfg.maybe == 3
    assert to_dict(cfg)["inner"]["steps"] == 5


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown config key 'inner\.lrr'"):
        override(Outer(), {"inner": {"lrr": 1.0}})


def test_bad_type_is_named():
    with pytest.raises(ConfigError, match=r"inner\.steps: expected an integer"):
        override(Outer(), {"inner": {"steps": "many"}})


def test_parse_dotted():
    assert parse_dotted(["inner.lr=0.5", "flag=true"]) == {"inner": {"lr": 0.5}, "flag": True}
    with pytest.raises(ConfigError):
        parse_dotted(["noequals"])


def test_train_task_families_as_list_or_weights_and_dotted_overrides():
    from tmax_jax.train.config import load_train_config

    cfg = load_train_config(None, {"tasks": {"families": ["largest_number", "cidr_membership"]}})
    assert cfg.tasks.family_weights() == {"largest_number": 1.0, "cidr_membership": 1.0}
    cfg = load_train_config(None, parse_dotted(["tasks.families={largest_number: 3, ini_edit: 1}"]))
    assert cfg.tasks.family_weights() == {"largest_number": 3, "ini_edit": 1}
    cfg = load_train_config(None, parse_dotted(["tasks.dir=[a, b]", "curriculum.enabled=true"]))
    assert cfg.tasks.dirs == ("a", "b") and cfg.curriculum.enabled
    assert load_train_config(None, {"tasks": {"dir": "one"}}).tasks.dirs == ("one",)
    with pytest.raises(ConfigError, match=r"tasks\.families: weights must be numbers > 0"):
        load_train_config(None, {"tasks": {"families": {"largest_number": -1}}})
    with pytest.raises(ConfigError, match=r"curriculum\.max_draws must be >= 1"):
        load_train_config(None, {"curriculum": {"max_draws": 0}})

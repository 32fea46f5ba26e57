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

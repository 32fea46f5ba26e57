"""The registry of procedural task families."""

from __future__ import annotations

FAMILIES: dict[str, object] = {}


def register(cls):
    inst = cls()
    if inst.name in FAMILIES:
        raise ValueError(f"duplicate task family {inst.name!r}")
    FAMILIES[inst.name] = inst
    return cls


def all_families() -> dict[str, object]:
    from tmax_jax.tasks.generator import families_code, families_sys, families_text_data  # noqa: F401

    return dict(FAMILIES)

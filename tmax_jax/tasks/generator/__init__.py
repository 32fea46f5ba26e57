"""Task generation (TMAX-style): the procedural generator over parametric task families."""

from tmax_jax.tasks.generator.procedural import Generated, ProceduralGenerator
from tmax_jax.tasks.generator.registry import all_families

__all__ = ["Generated", "ProceduralGenerator", "all_families"]

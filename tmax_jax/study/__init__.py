"""``tmax-jax study``: a base train config, named variants, seeds; every run, then the comparison."""

from tmax_jax.study.compare import compare
from tmax_jax.study.report import write_report
from tmax_jax.study.runner import StudyInterrupted, commands, run_study
from tmax_jax.study.spec import Study, load_study

__all__ = ["Study", "StudyInterrupted", "commands", "compare", "load_study", "run_study", "write_report"]

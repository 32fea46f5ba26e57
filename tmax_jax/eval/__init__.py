"""Evaluation over Harbor-format task directories: pass@k, resumable runs, reports.

from tmax_jax.eval import EvalConfig, OracleAgent, evaluate
summary = evaluate("tests/tasks", OracleAgent(), "runs/eval/oracle", EvalConfig(k=1))
summary["overall"]["pass_at"]["1"]      # 1.0
"""

from tmax_jax.eval.agents import Agent, NoopAgent, OracleAgent
from tmax_jax.eval.passk import mean_pass_at_k, pass_at_k
from tmax_jax.eval.runner import EvalConfig, evaluate

__all__ = ["Agent", "EvalConfig", "NoopAgent", "OracleAgent", "evaluate", "mean_pass_at_k", "pass_at_k"]

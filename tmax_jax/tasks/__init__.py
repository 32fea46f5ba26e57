"""Task formats (Harbor / Terminal-Bench 2.0 and TMAX / Endless-Terminals) and the task runner.

from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task
result = run_task(load_task("tests/tasks/harbor_hello"), agent="oracle")   # result.reward == 1.0
"""

from tmax_jax.tasks.loader import find_tasks, load_task
from tmax_jax.tasks.model import EnvironmentSpec, Task, TaskLimits

__all__ = ["EnvironmentSpec", "Task", "TaskLimits", "find_tasks", "load_task"]

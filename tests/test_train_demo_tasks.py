"""The demo family's tasks are real Harbor tasks: the oracle scores 1, a no-op and a wrong word 0."""

from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task
from tmax_jax.train.demo_tasks import write_tasks


def test_oracle_noop_and_wrong_answer(tmp_path):
    paths = write_tasks(tmp_path, [3, 4], num_files=3)
    task = load_task(paths[0])
    assert task.format == "harbor" and task.instruction.startswith("Write the word ")
    word = task.instruction.split()[3]
    file = task.instruction.split()[-1].rstrip(".")
    assert run_task(task, "oracle").reward == 1.0
    assert run_task(task, None).reward == 0.0

    def wrong(task, shell):
        shell.run(f"echo not{word} > {file}")

    def right_by_hand(task, shell):
        shell.run(f"cd /app && echo '  {word}' > {file}")

    assert run_task(task, wrong).reward == 0.0
    assert run_task(task, right_by_hand).reward == 1.0

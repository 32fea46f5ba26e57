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


def test_largest_number_oracle_glob_and_wrong_answer(tmp_path):
    from tmax_jax.train.demo_tasks import HELDOUT_NAMES, TRAIN_NAMES, write_largest_task

    train = load_task(write_largest_task(tmp_path / "t", 11))
    held = load_task(write_largest_task(tmp_path / "h", 11, heldout=True))
    name = train.instruction.split("/app/data/")[1].split(".txt")[0]
    assert name in TRAIN_NAMES and held.instruction.split("/app/data/")[1].split(".txt")[0] in HELDOUT_NAMES
    numbers = [int(x) for x in (train.path / "environment" / "data" / f"{name}.txt").read_text().split()]
    assert int(train.instruction.split(" holds ")[1].split()[0]) == len(numbers)
    assert run_task(train, "oracle").reward == 1.0 and run_task(held, "oracle").reward == 1.0
    assert run_task(train, None).reward == 0.0

    def smallest(task, shell):
        shell.run("sort -n /app/data/* | head -1 > /app/answer.txt")

    def by_hand(task, shell):
        assert shell.run(f"cat /app/data/{name}.txt").stdout.split() == [str(n) for n in numbers]
        shell.run(f"echo {max(numbers)} > /app/answer.txt")

    assert run_task(train, smallest).reward == 0.0
    assert run_task(train, by_hand).reward == 1.0


def test_unsubmitted_episode_scores_zero_when_submit_is_required(tmp_path):
    """The same correct command replayed with and without the submit marker: the verifier passes
    both, only the submitted episode keeps its reward when the run requires the submit."""
    from tmax_jax.agent import BASH_TOOL
    from tmax_jax.agent.chat import ChatFormatter
    from tmax_jax.agent.episode import AgentConfig, run_episode
    from tmax_jax.agent.scripted import ScriptedPolicy
    from tmax_jax.tokenizer import train_tiny_tokenizer
    from tmax_jax.train.demo_tasks import LARGEST_SOLUTION, write_largest_task
    from tmax_jax.train.rollout import score_episode, solution_commands

    chat = ChatFormatter(train_tiny_tokenizer(tmp_path / "tok"), tools=[BASH_TOOL])
    task = load_task(write_largest_task(tmp_path / "t", 5))
    assert solution_commands(task.solution.read_text()) == list(LARGEST_SOLUTION)
    assert solution_commands("#!/bin/bash\nset -e\ncd /x\necho y\n") == ["set -e\ncd /x\necho y"]
    cfg = AgentConfig(max_turns=4)
    out = {}
    for submit in (True, False):
        policy = ScriptedPolicy(solution_commands(task.solution.read_text()), chat, submit=submit)
        result = run_task(
            task, lambda t, sh, p=policy: run_episode(t.instruction, p, sh, chat, cfg, task_id=t.name)
        )
        assert result.reward == 1.0  # the file is right either way
        for required in (True, False):
            traj = score_episode(result.agent_output, result, require_submit=required)
            out[submit, required] = (traj.reward, traj.info["passed"], traj.finish_reason)
    assert out[True, True] == (1.0, True, "submitted") and out[True, False] == (1.0, True, "submitted")
    assert result.agent_output.num_turns == 4  # two commands, then (no submit) two more replies
    assert out[False, False] == (1.0, True, "max_turns")
    assert out[False, True] == (0.0, False, "max_turns")


def test_data_families_need_their_own_command(tmp_path):
    """Each data-file family's oracle scores 1, a no-op 0, and every other family's command 0: a
    policy that ignores which one the instruction asks for cannot score on all of them."""
    from tmax_jax.train.demo_tasks import DATA_FAMILIES, HELDOUT_NAMES

    assert set(DATA_FAMILIES) >= {"largest_number", "count_errors", "column_sum"}
    for name, fam in DATA_FAMILIES.items():
        task = load_task(fam.write(tmp_path / name, 5, heldout=True))
        assert any(f"/{n}.{fam.suffix}" in task.instruction for n in HELDOUT_NAMES)
        assert run_task(task, "oracle").reward == 1.0, name
        assert run_task(task, None).reward == 0.0, name
        for other in DATA_FAMILIES.values():
            if other.name == name:
                continue

            def theirs(task, shell, cmds=other.solution):
                for c in cmds:
                    shell.run(c)

            assert run_task(task, theirs).reward == 0.0, (name, other.name)

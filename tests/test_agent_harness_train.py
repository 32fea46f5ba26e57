"""The harness as part of a training run: config and run identity, and SFT demonstrations under it."""

from pathlib import Path

import pytest

from tmax_jax.agent.episode import AgentConfig, make_chat
from tmax_jax.config import override, parse_dotted
from tmax_jax.errors import ConfigError
from tmax_jax.sandbox import SandboxConfig
from tmax_jax.tasks import load_task
from tmax_jax.tokenizer import train_tiny_tokenizer
from tmax_jax.train.config import TrainConfig
from tmax_jax.train.rollout import demonstrations
from tmax_jax.train.setup import prepare_run_dir

TASKS = Path(__file__).parent / "tasks"


def test_harness_is_part_of_the_run_identity(tmp_path):
    cfg = override(TrainConfig(), {"run_dir": str(tmp_path), **parse_dotted(["agent.harness=openhands"])})
    assert cfg.harness == "openhands"
    prepare_run_dir(cfg)
    assert "harness: openhands" in (tmp_path / "config.yaml").read_text()
    prepare_run_dir(cfg)  # the same run resumes
    other = override(cfg, {"agent": {"harness": "terminus"}})
    with pytest.raises(ConfigError, match="changed: agent"):
        prepare_run_dir(other)
    with pytest.raises(ConfigError, match="agent.harness='vim'"):
        override(TrainConfig(), {"agent": {"harness": "vim"}})
    # A run recorded before harnesses had their own prompts (the bash prompt spelled out) is the same run.
    legacy = AgentConfig(
        system_prompt="You are an expert terminal agent. Solve the task by running bash commands with the "
        "bash tool, one tool call per reply. When the task is complete, run "
        "`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`."
    )
    assert legacy == AgentConfig()


def test_demonstrations_replay_solutions_under_the_configured_harness(tmp_path):
    from tmax_jax.train.demo_tasks import write_largest_task

    cfg = AgentConfig(harness="mini-swe", max_context_tokens=8192, max_turns=4)
    chat = make_chat(train_tiny_tokenizer(tmp_path / "tok"), cfg)
    task = load_task(TASKS / "harbor_csv_sum")
    # A one-turn-per-line solution (cd, then a command relying on it) stays correct under mini-swe,
    # whose actions each run in a fresh shell: the steps become one script.
    per_line = load_task(write_largest_task(tmp_path / "t", 3))
    demos, rejected = demonstrations([task, per_line], chat, cfg, SandboxConfig(), workers=1)
    assert not rejected and len(demos) == 2
    assert "cd /app/data\nsort -n" in demos[1].messages[2]["content"] and demos[1].reward == 1.0
    d = demos[0]
    assert d.reward == 1.0 and d.finish_reason == "submitted"
    # The replies are mini-swe's fenced blocks and its observations user turns, in the tokens trained on.
    assert [m["role"] for m in d.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert d.messages[2]["content"].count("```bash") == 1 and "awk -F," in d.messages[2]["content"]
    assert d.messages[3]["content"].startswith("<returncode>0</returncode>")
    assert chat.decode([t for t, m in zip(d.tokens, d.response_mask) if m]).count("```bash") == 2

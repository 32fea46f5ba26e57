"""The episode loop on a real tokenizer (chat template) and a real bwrap sandbox shell."""

import pytest

from tmax_jax.agent import BASH_TOOL, SUBMIT_MARKER
from tmax_jax.agent.chat import ChatFormatter
from tmax_jax.agent.episode import AgentConfig, Generation, run_episode
from tmax_jax.agent.scripted import ScriptedPolicy
from tmax_jax.sandbox import SandboxConfig, make_sandbox
from tmax_jax.tokenizer import train_tiny_tokenizer


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    tok = train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return ChatFormatter(tok, tools=[BASH_TOOL], template_kwargs={"enable_thinking": False})


@pytest.fixture()
def shell():
    with make_sandbox(SandboxConfig()) as sb:
        sh = sb.shell()
        yield sh
        sh.close()


def test_response_mask_covers_exactly_generated_tokens(chat, shell):
    policy = ScriptedPolicy(["cd /tmp && export GREETING=hi", "echo $GREETING from $(pwd)"], chat)
    traj = run_episode("Say hi from /tmp.", policy, shell, chat, AgentConfig(), task_id="t0")
    assert traj.finish_reason == "submitted" and traj.num_turns == 3 and traj.num_format_errors == 0

    # Re-derive the trajectory independently: the chat template rendering of the whole conversation,
    # with the assistant turns' text, must be exactly the decoded token stream (each assistant turn was
    # generated after the template's empty think block, which the history rendering leaves out).
    full_text = chat.tokenizer.apply_chat_template(
        traj.messages, tools=[BASH_TOOL], tokenize=False, enable_thinking=False
    )
    full_text = full_text.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert chat.decode(traj.tokens) == full_text.rstrip("\n")

    # The masked-in tokens are exactly the policy's replies (each ending with <|im_end|>).
    spans, cur = [], []
    for tok, m in zip(traj.tokens, traj.response_mask):
        if m:
            cur.append(tok)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    assert [chat.decode(s) for s in spans] == [r + "<|im_end|>" for r in policy.replies]
    # Shell state persisted across calls and the observation reached the model's context.
    assert "hi from /tmp" in traj.messages[5]["content"] and "(exit_code=0)" in traj.messages[5]["content"]
    assert traj.messages[-1]["content"].count("<tool_call>") == 1
    assert all(lp == 0.0 for lp, m in zip(traj.rollout_logprobs, traj.response_mask) if not m)
    assert SUBMIT_MARKER in traj.messages[-1]["content"]


def test_format_errors_are_fed_back_and_counted(chat, shell):
    class Babbler:
        def __call__(self, new_tokens, *, max_new_tokens):
            ids = chat.encode("no tool here") + [chat.end_id]
            return Generation(ids, [-1.0] * len(ids), [0] * len(ids), "stop")

    traj = run_episode("x", Babbler(), shell, chat, AgentConfig(max_format_errors=2, max_turns=10))
    assert traj.finish_reason == "format_errors" and traj.num_format_errors == 3
    assert traj.messages[3]["content"].startswith("Format error: no tool call found")


def test_turn_and_context_limits(chat, shell):
    policy = ScriptedPolicy(["true"] * 10, chat, submit=False)
    traj = run_episode("x", policy, shell, chat, AgentConfig(max_turns=3))
    assert traj.finish_reason == "max_turns" and traj.num_turns == 3
    small = run_episode(
        "x", ScriptedPolicy(["true"] * 10, chat), shell, chat, AgentConfig(max_context_tokens=300)
    )
    assert small.finish_reason in ("context_limit",) and len(small.tokens) <= 300


def test_truncated_reply_gets_end_token_glue(chat, shell):
    policy = ScriptedPolicy(["echo " + "x" * 200], chat)
    traj = run_episode("x", policy, shell, chat, AgentConfig(max_tokens_per_turn=8, max_turns=2))
    # The cut reply is closed by the harness with <|im_end|> that the policy did not generate.
    first_gen = [i for i, m in enumerate(traj.response_mask) if m][:8]
    after = first_gen[-1] + 1
    assert traj.response_mask[after] == 0 and traj.tokens[after] == chat.end_id

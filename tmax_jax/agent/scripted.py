"""A policy that replays fixed commands: turns a reference solution into a demonstration trajectory.

Used for the SFT warm start (the tiny random model has to learn the tool format first) and for
testing the harness; its tokens are the canonical tool-call text, its logprobs are 0.
"""

from __future__ import annotations

from tmax_jax.agent.chat import ChatFormatter
from tmax_jax.agent.episode import Generation
from tmax_jax.agent.protocol import SUBMIT_MARKER, render_tool_call


class ScriptedPolicy:
    def __init__(self, commands: list[str], chat: ChatFormatter, *, submit: bool = True, preamble: str = ""):
        self.replies = [preamble + render_tool_call(c) for c in commands]
        if submit:
            self.replies.append(render_tool_call(f"echo {SUBMIT_MARKER}"))
        self.chat = chat
        self.turn = 0

    def __call__(self, new_tokens: list[int], *, max_new_tokens: int) -> Generation:
        if self.turn >= len(self.replies):
            text = "I have nothing more to do."
        else:
            text = self.replies[self.turn]
        self.turn += 1
        ids = self.chat.encode(text) + [self.chat.end_id]
        finish = "stop"
        if len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        return Generation(
            tokens=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids), finish_reason=finish
        )

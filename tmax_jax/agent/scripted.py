"""A policy that replays fixed commands: turns a reference solution into a demonstration trajectory.

Used for the SFT warm start (the tiny random model has to learn the tool format first) and for
testing the harnesses; its tokens are the harness's canonical reply text, its logprobs are 0.
"""

from __future__ import annotations

from tmax_jax.agent.chat import ChatFormatter
from tmax_jax.agent.episode import Generation
from tmax_jax.agent.harness import get_harness


class ScriptedPolicy:
    """Replies with ``commands`` rendered for ``harness`` (then its submit replies), or with ``replies``
    verbatim when given. Under a harness without a persistent shell (mini-swe) the commands are one
    script, so a ``cd`` in one still holds in the next."""

    def __init__(
        self,
        commands: list[str],
        chat: ChatFormatter,
        *,
        submit: bool = True,
        preamble: str = "",
        harness: str = "bash",
        replies: list[str] | None = None,
    ):
        h = get_harness(harness)
        if replies is not None:
            self.replies = list(replies)
        else:
            if not h.persistent_shell and len(commands) > 1:
                # Steps that rely on an earlier step's cd/export become one script (one action).
                commands = ["\n".join(commands)]
            self.replies = [preamble + h.render_command(c) for c in commands]
            if submit:
                self.replies.extend(h.render_submit())
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

"""What an episode does when its context fills up (the policy, in order):

1. Every observation is cut to ``max_output_chars`` by its harness, keeping head and tail with a
   marker saying how much was cut (always, not only near the limit).
2. Token episodes (training, ``--checkpoint`` evals): the context is the policy's exact token
   stream, so nothing already in it is rewritten (later tokens were sampled after it; a rewrite would
   make the trajectory off-policy for the trainer). A new observation that would leave less than
   ``reserve`` tokens (``min(max_tokens_per_turn, context_reserve_tokens)``) for the next reply is
   cut head and tail until it fits, with a marker.
3. Re-sent conversations (``--llm-url`` evals, where the server re-reads the messages each turn):
   when the next prompt would pass ``elide_at`` of ``max_context_tokens``, the oldest observations
   are replaced by a one-line note (``[output elided ...]``) until it fits, always keeping the
   ``keep_recent_outputs`` newest ones, the system prompt, the task and every assistant reply.
4. When even that leaves no room (less than ``MIN_OBSERVATION_TOKENS`` for the observation, or no
   observation left to elide) the episode ends with ``finish_reason == "context_exhausted"``; its
   trajectory is kept and scored like any other.
"""

from __future__ import annotations

from typing import Any

CONTEXT_EXHAUSTED = "context_exhausted"
MIN_OBSERVATION_TOKENS = 32
ELIDED = "[output elided to save context: {n} characters]"


def cut_to_chars(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}\n[... {len(text) - max_chars} characters cut to fit the context ...]\n{text[len(text) - tail :]}"


def fit_observation(
    chat: Any, role: str, text: str, *, ended_with_eos: bool, room: int, reserve: int
) -> tuple[dict, list[int]] | None:
    """The observation message and its continuation tokens, cut to leave ``reserve`` of ``room``
    tokens; None when not even ``MIN_OBSERVATION_TOKENS`` of it would fit."""

    def encode(body: str) -> tuple[dict, list[int]]:
        msg = {"role": role, "content": body}
        return msg, chat.continuation_ids([msg], ended_with_eos=ended_with_eos)

    msg, ids = encode(text)
    if len(ids) + reserve <= room:
        return msg, ids
    overhead = len(encode("")[1])
    target = room - reserve - overhead
    if target < MIN_OBSERVATION_TOKENS:
        return None
    content_tokens = max(1, len(ids) - overhead)
    chars = int(len(text) * target / content_tokens)
    for _ in range(8):
        msg, ids = encode(cut_to_chars(text, max(chars, 0)))
        if len(ids) + reserve <= room:
            return msg, ids
        chars = int(chars * 0.8) - 16
        if chars <= 0:
            break
    return None


def estimate_tokens(messages: list[dict]) -> int:
    """A rough count for a conversation we do not tokenise (4 characters a token, plus framing)."""
    return sum(len(str(m.get("content") or "")) // 4 + 8 for m in messages)


def elide_old_outputs(
    messages: list[dict], roles: tuple[str, ...], *, keep_recent: int, limit_tokens: int
) -> bool:
    """Elide the oldest observations (messages of ``roles`` after the task) until the conversation's
    estimate is within ``limit_tokens``; True when it is."""
    candidates = [i for i, m in enumerate(messages[2:], 2) if m.get("role") in roles]
    candidates = candidates[: max(0, len(candidates) - keep_recent)]
    for i in candidates:
        if estimate_tokens(messages) <= limit_tokens:
            break
        content = str(messages[i].get("content") or "")
        if not content.startswith("[output elided"):
            messages[i] = {**messages[i], "content": ELIDED.format(n=len(content))}
    return estimate_tokens(messages) <= limit_tokens

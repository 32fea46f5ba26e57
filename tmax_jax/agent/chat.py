"""Chat-template glue: the token ids of a conversation built turn by turn.

The policy's own tokens are never re-tokenised (their logprobs must stay aligned), so each turn we
only tokenise what the harness adds: the template text of the new messages plus the template's glue
after the assistant's end-of-turn token. That text is found by rendering a fixed two-message dummy
conversation with and without the new messages, which works for any template that renders earlier
messages independently of later ones.
"""

from __future__ import annotations

from typing import Any

from tmax_jax.errors import TmaxError

_DUMMY = [{"role": "user", "content": "DUMMY-USER"}, {"role": "assistant", "content": "DUMMY-ASSISTANT"}]


class ChatFormatter:
    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: list[dict] | None = None,
        end_token: str = "<|im_end|>",
        template_kwargs: dict | None = None,
    ):
        if getattr(tokenizer, "chat_template", None) is None:
            raise TmaxError(
                "the tokenizer has no chat template (tokenizer_config.json needs 'chat_template')"
            )
        self.tokenizer = tokenizer
        self.tools = tools
        self.end_token = end_token
        # e.g. {"enable_thinking": False}: passed to every render of the template.
        self.template_kwargs = dict(template_kwargs or {})
        end_id = tokenizer.convert_tokens_to_ids(end_token)
        if end_id is None or end_id == getattr(tokenizer, "unk_token_id", object()):
            raise TmaxError(f"the tokenizer has no end-of-turn token {end_token!r}")
        self.end_id: int = int(end_id)
        base = self._render(_DUMMY, add_generation_prompt=False)
        idx = base.rfind(end_token)
        if idx < 0:
            raise TmaxError(f"the chat template does not end assistant turns with {end_token!r}")
        self._glue_after_end = base[idx + len(end_token) :]
        self._base = base
        # Control tokens (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ...) as they could appear
        # in a command's output. Tags the model writes itself (``<tool_call>``, ``<think>``) stay tokens:
        # the harness's own format hints use them.
        names = {
            *getattr(tokenizer, "all_special_tokens", []),
            *getattr(tokenizer, "get_added_vocab", dict)(),
        }
        self._specials = sorted(
            (t for t in names if t.startswith("<|") and t.endswith("|>")), key=len, reverse=True
        )

    def _inert(self, text: str) -> str:
        """``text`` with every control-token string broken by a zero-width space after its first
        character, so that tokenising it gives ordinary text tokens: a command's output (which the
        agent controls) cannot open or close turns in its own context."""
        for t in self._specials:
            if t in text:
                text = text.replace(t, t[0] + "\u200b" + t[1:])
        return text

    def _render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The opening context (system + user), ending with the assistant generation prompt."""
        return self.encode(self._render(messages, add_generation_prompt=True))

    def continuation_ids(self, new_messages: list[dict], *, ended_with_eos: bool) -> list[int]:
        """Tokens after an assistant turn: template glue, the new (tool/user) messages, next generation
        prompt. Control-token strings inside the messages' text are made inert (``_inert``)."""
        new_messages = [
            {**m, "content": self._inert(m["content"])} if isinstance(m.get("content"), str) else m
            for m in new_messages
        ]
        full = self._render(_DUMMY + new_messages, add_generation_prompt=True)
        if not full.startswith(self._base):
            raise TmaxError("the chat template renders earlier messages differently when more follow")
        text = self._glue_after_end + full[len(self._base) :]
        if not ended_with_eos:
            text = self.end_token + text
        return self.encode(text)

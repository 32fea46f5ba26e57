"""An OpenAI-compatible HTTP server over the orchestrator (stdlib ``http.server``, one thread per client).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (the checkpoint's chat template; ``stream``; ``logprobs``; ``n``;
``stop``; ``seed``; ``top_k`` as an extension). Every choice also carries ``token_ids`` and
``policy_versions`` so RL harnesses get the exact sampled tokens. Bad requests get a 4xx JSON error
naming the problem; an internal failure is a 500 for that request only.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tmax_jax.engine.orchestrator import EngineBusy, Orchestrator, Request, RequestHandle
from tmax_jax.engine.sampling import SamplingParams, derive_seed
from tmax_jax.errors import ConfigError

MAX_BODY_BYTES = 16 << 20


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def _get(body: dict, name: str, types: type | tuple, default: Any = None, *, allow_none: bool = True) -> Any:
    value = body.get(name, default)
    if value is None and allow_none:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"'{name}' must be {_type_names(types)}, got {value!r}", param=name)
    if not isinstance(value, types):
        raise BadRequest(f"'{name}' must be {_type_names(types)}, got {type(value).__name__}", param=name)
    return value


def _type_names(types: type | tuple) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                        list: "a list", dict: "an object"}.get(t, t.__name__) for t in types)  # fmt: skip


class OpenAIServer:
    """Serves ``orchestrator`` over HTTP. ``start()`` runs it on a background thread."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenizer: Any,
        *,
        model_name: str = "tmax-jax",
        host: str = "127.0.0.1",
        port: int = 8000,
        default_max_tokens: int = 256,
    ):
        if tokenizer is None:
            raise ConfigError("OpenAIServer needs a tokenizer (the checkpoint directory's)")
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None
        end = (
            tokenizer.convert_tokens_to_ids("<|im_end|>")
            if hasattr(tokenizer, "convert_tokens_to_ids")
            else None
        )
        self._chat_stop_ids = tuple(
            {int(t) for t in (end, getattr(tokenizer, "eos_token_id", None)) if isinstance(t, int) and t >= 0}
        )

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self._httpd.server_address[0]
        return f"http://{host}:{self.port}"

    def start(self) -> OpenAIServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="tmax-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # ----------------------------------------------------------------- request parsing
    def _sampling(self, body: dict, index: int) -> SamplingParams:
        temperature = float(_get(body, "temperature", (int, float), 1.0))
        top_p = float(_get(body, "top_p", (int, float), 1.0))
        top_k = _get(body, "top_k", int, 0)
        if top_k == -1:
            top_k = 0
        seed = _get(body, "seed", int, None)
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little") >> 1
        try:
            return SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, seed=derive_seed(seed, index)
            )
        except ConfigError as e:
            raise BadRequest(str(e)) from None

    def _common(self, body: dict, max_tokens_key: str = "max_tokens") -> dict:
        max_tokens = _get(body, max_tokens_key, int, None)
        if max_tokens is None and max_tokens_key != "max_tokens":
            max_tokens = _get(body, "max_tokens", int, None)
        max_tokens = self.default_max_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise BadRequest(f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise BadRequest("'stop' must be a string or a list of non-empty strings", param="stop")
        n = _get(body, "n", int, 1)
        if not 1 <= n <= 64:
            raise BadRequest(f"'n' must be in [1, 64], got {n}", param="n")
        stream = _get(body, "stream", bool, False)
        return dict(max_tokens=max_tokens, stop=tuple(stop), n=n, stream=stream)

    def _completion_prompts(self, body: dict) -> list[list[int]]:
        if "prompt" not in body:
            raise BadRequest("missing required field 'prompt'", param="prompt")
        p = body["prompt"]
        if isinstance(p, str):
            return [self.tokenizer.encode(p, add_special_tokens=False)]
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [list(p)]
        if isinstance(p, list) and p and all(isinstance(s, str) for s in p):
            return [self.tokenizer.encode(s, add_special_tokens=False) for s in p]
        if isinstance(p, list) and p and all(isinstance(s, list) for s in p):
            if not all(all(isinstance(t, int) and not isinstance(t, bool) for t in s) for s in p):
                raise BadRequest("'prompt' token lists must hold integers", param="prompt")
            return [list(s) for s in p]
        raise BadRequest("'prompt' must be a string, a list of strings, or token id list(s)", param="prompt")

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
                raise BadRequest(
                    f"messages[{i}] needs a role of system/user/assistant/tool", param="messages"
                )
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                texts = [
                    c.get("text", "") for c in content if isinstance(c, dict) and c.get("type") == "text"
                ]
                m = dict(m, content="".join(texts))
                messages[i] = m
            elif content is not None and not isinstance(content, str):
                raise BadRequest(
                    f"messages[{i}].content must be a string or a list of parts", param="messages"
                )
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("'tools' must be a list", param="tools")
        kwargs = {}
        if isinstance(body.get("chat_template_kwargs"), dict):
            kwargs.update(body["chat_template_kwargs"])
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs
            )
        except Exception as e:  # jinja errors on malformed messages
            raise BadRequest(f"chat template failed on these messages: {e}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    # ----------------------------------------------------------------- generation
    def _submit(self, prompt: list[int], common: dict, body: dict, index: int, stop_ids) -> RequestHandle:
        req = Request(
            prompt=prompt,
            max_tokens=common["max_tokens"],
            sampling=self._sampling(body, index),
            stop_token_ids=stop_ids,
            stop=common["stop"],
        )
        try:
            return self.orchestrator.submit(req, block=False)
        except EngineBusy as e:
            raise BadRequest(str(e), status=503) from None
        except ConfigError as e:
            raise BadRequest(str(e)) from None

    def _text(self, tokens: list[int], stop_ids: tuple[int, ...], stop_string: str | None) -> str:
        if tokens and tokens[-1] in stop_ids:
            tokens = tokens[:-1]
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        if stop_string is not None and stop_string in text:
            text = text[: text.index(stop_string)]
        return text

    def _token_strs(self, tokens: list[int]) -> list[str]:
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]

    def _stop_ids_for(self, body: dict, chat: bool) -> tuple[int, ...] | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        ids = set(self._chat_stop_ids) if chat else ({int(eos)} if isinstance(eos, int) else set())
        extra = body.get("stop_token_ids")
        if extra is not None:
            if not (
                isinstance(extra, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in extra)
            ):
                raise BadRequest("'stop_token_ids' must be a list of integers", param="stop_token_ids")
            ids |= set(extra)
        return tuple(sorted(ids)) if ids else None

    # ----------------------------------------------------------------- responses
    def completions(self, body: dict) -> tuple[dict | Iterator[dict], bool]:
        common = self._common(body)
        if body.get("echo"):
            raise BadRequest("'echo' is not supported", param="echo")
        logprobs = _get(body, "logprobs", int, None)
        if logprobs is not None and not 0 <= logprobs <= 5:
            raise BadRequest("'logprobs' must be in [0, 5]", param="logprobs")
        prompts = self._completion_prompts(body)
        stop_ids = self._stop_ids_for(body, chat=False)
        handles = [
            self._submit(p, common, body, i * common["n"] + j, stop_ids)
            for i, p in enumerate(prompts)
            for j in range(common["n"])
        ]
        rid = f"cmpl-{uuid.uuid4().hex}"
        if common["stream"]:
            return self._stream(rid, "text_completion", handles, stop_ids, common["stop"], chat=False), True
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for idx, h in enumerate(handles):
            c = h.result()
            choice = {
                "index": idx,
                "text": self._text(c.tokens, stop_ids or (), c.stop_string),
                "finish_reason": "stop" if c.finish_reason == "stop" else "length",
                "logprobs": None,
                "token_ids": c.tokens,
                "policy_versions": c.versions,
            }
            if logprobs is not None:
                strs = self._token_strs(c.tokens)
                offsets = [sum(len(s) for s in strs[:i]) for i in range(len(strs))]
                choice["logprobs"] = {
                    "tokens": strs,
                    "token_logprobs": c.logprobs,
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
            choices.append(choice)
            usage["prompt_tokens"] += c.prompt_tokens if idx % common["n"] == 0 else 0
            usage["completion_tokens"] += len(c.tokens)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
               "choices": choices, "usage": usage}  # fmt: skip
        return out, False

    def chat_completions(self, body: dict) -> tuple[dict | Iterator[dict], bool]:
        common = self._common(body, "max_completion_tokens")
        want_logprobs = _get(body, "logprobs", bool, False)
        prompt = self._chat_prompt(body)
        stop_ids = self._stop_ids_for(body, chat=True)
        handles = [self._submit(prompt, common, body, j, stop_ids) for j in range(common["n"])]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if common["stream"]:
            return self._stream(
                rid, "chat.completion.chunk", handles, stop_ids, common["stop"], chat=True
            ), True
        choices, completion_tokens = [], 0
        for idx, h in enumerate(handles):
            c = h.result()
            text = self._text(c.tokens, stop_ids or (), c.stop_string)
            choice = {
                "index": idx,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop" if c.finish_reason == "stop" else "length",
                "logprobs": None,
                "token_ids": c.tokens,
                "policy_versions": c.versions,
            }
            calls = _tool_calls(text)
            if calls:
                choice["message"]["tool_calls"] = calls
                choice["finish_reason"] = "tool_calls" if c.finish_reason == "stop" else "length"
            if want_logprobs:
                choice["logprobs"] = {"content": [
                    {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                    for s, lp in zip(self._token_strs(c.tokens), c.logprobs)
                ]}  # fmt: skip
            choices.append(choice)
            completion_tokens += len(c.tokens)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                 "total_tokens": len(prompt) + completion_tokens}  # fmt: skip
        out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
               "choices": choices, "usage": usage}  # fmt: skip
        return out, False

    def _stream(self, rid, obj, handles, stop_ids, stops, *, chat: bool) -> Iterator[dict]:
        """Chunks per token, choice by choice; text is held back while it may be a stop string's start."""
        hold = max((len(s) for s in stops), default=1) - 1
        stop_ids = stop_ids or ()
        created = int(time.time())
        try:
            for idx, h in enumerate(handles):
                if chat:
                    yield self._chunk(
                        rid, obj, created, idx, {"role": "assistant", "content": ""}, None, chat
                    )
                tokens: list[int] = []
                sent = 0
                for ev in h:
                    tokens.append(ev.token)
                    text = self._text(tokens, stop_ids, None)
                    cut = min((text.find(s) for s in stops if s in text), default=-1)
                    if cut >= 0:
                        text = text[:cut]
                    safe = len(text) if cut >= 0 else max(sent, len(text) - hold)
                    if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
                        safe = min(safe, len(text) - 1)
                    delta = text[sent:safe]
                    sent = max(sent, safe)
                    extra = {"token_ids": [ev.token], "logprobs": None}
                    extra["logprobs"] = (
                        {"content": [{"token": self._token_strs([ev.token])[0], "logprob": ev.logprob, "top_logprobs": []}]}
                        if chat else {"tokens": self._token_strs([ev.token]), "token_logprobs": [ev.logprob]}
                    )  # fmt: skip
                    yield self._chunk(rid, obj, created, idx, delta, None, chat, extra)
                c = h.result()
                final = self._text(c.tokens, stop_ids, c.stop_string)
                yield self._chunk(
                    rid,
                    obj,
                    created,
                    idx,
                    final[sent:],
                    "stop" if c.finish_reason == "stop" else "length",
                    chat,
                )
        finally:
            for h in handles:  # the client went away: stop spending compute on it
                if not h.done:
                    h.cancel()

    def _chunk(self, rid, obj, created, idx, delta, finish, chat: bool, extra: dict | None = None) -> dict:
        if chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": idx, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": idx, "text": delta, "finish_reason": finish}
        if extra:
            choice.update(extra)
        return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}

    def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tmax-jax"}
        ]}  # fmt: skip

    # ----------------------------------------------------------------- HTTP
    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "tmax-jax"

            def log_message(self, fmt, *args):  # keep test output and stderr quiet
                return

            def _send_json(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str, param: str | None = None) -> None:
                kind = "invalid_request_error" if status < 500 else "server_error"
                self._send_json(
                    status, {"error": {"message": message, "type": kind, "param": param, "code": status}}
                )

            def do_GET(self):
                path = self.path.split("?", 1)[0].rstrip("/")
                if path == "/health":
                    self._send_json(200, {"status": "ok"})
                elif path == "/v1/models":
                    self._send_json(200, server.models())
                else:
                    self._error(404, f"no route GET {self.path}")

            def do_POST(self):
                path = self.path.split("?", 1)[0].rstrip("/")
                routes = {
                    "/v1/completions": server.completions,
                    "/v1/chat/completions": server.chat_completions,
                }
                if path not in routes:
                    self._error(404, f"no route POST {self.path}")
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    self._error(400, "bad Content-Length header")
                    return
                if length <= 0:
                    self._error(400, "request body is empty; send a JSON object")
                    return
                if length > MAX_BODY_BYTES:
                    self._error(413, f"request body over {MAX_BODY_BYTES} bytes")
                    return
                try:
                    body = json.loads(self.rfile.read(length))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    self._error(400, f"request body is not valid JSON: {e}")
                    return
                if not isinstance(body, dict):
                    self._error(400, "request body must be a JSON object")
                    return
                try:
                    result, streaming = routes[path](body)
                except BadRequest as e:
                    self._error(e.status, str(e), e.param)
                    return
                except Exception as e:  # keep serving other requests
                    self._error(500, f"internal error: {type(e).__name__}: {e}")
                    return
                if not streaming:
                    self._send_json(200, result)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                try:
                    for chunk in result:
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    result.close()  # runs the generator's finally: cancels the requests
                except Exception as e:
                    err = {
                        "error": {
                            "message": f"internal error: {type(e).__name__}: {e}",
                            "type": "server_error",
                        }
                    }
                    self.wfile.write(f"data: {json.dumps(err)}\n\n".encode())

        return Handler


def _tool_calls(text: str) -> list[dict]:
    """OpenAI ``tool_calls`` for the Qwen 3.5 XML calls in ``text`` (none when absent or malformed)."""
    if "<tool_call>" not in text:
        return []
    from tmax_jax.agent.protocol import FormatError, parse_tool_calls

    names = tuple(sorted({m.split(">", 1)[0] for m in text.split("<function=")[1:]}))
    try:
        calls = parse_tool_calls(text, tools=names)
    except FormatError:
        return []
    return [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for c in calls
    ]  # fmt: skip

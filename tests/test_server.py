"""The OpenAI-compatible server answers a real HTTP client (stdlib urllib), streams, returns logprobs,
rejects malformed requests with 4xx and keeps serving; ``tmax-jax serve`` starts it from a checkpoint."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from helpers_hf import make_tiny_hf_checkpoint
from xla_flags import xla_flags

from tmax_jax.checkpoints import load_hf
from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams
from tmax_jax.engine.server import OpenAIServer
from tmax_jax.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("server"), seed=2, tokenizer=True, vocab_size=512)


@pytest.fixture(scope="module")
def served(ckpt):
    tok = load_tokenizer(ckpt)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engine = Engine(
        load_hf(ckpt), max_concurrent_decodes=4, max_cache_length=256, max_prefill_length=128,
        eos_token_ids=[eos], tokenizer=tok,
    )  # fmt: skip
    with Orchestrator(engine) as orch:
        server = OpenAIServer(orch, tok, model_name="tiny", port=0).start()
        yield server, orch, tok
        server.shutdown()


def post(url, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(url, body):
    req = urllib.request.Request(
        url, data=json.dumps(dict(body, stream=True)).encode(), headers={"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def greedy_ids(orch, prompt_ids, n, stop_ids):
    req = Request(
        prompt=prompt_ids, max_tokens=n, sampling=SamplingParams(temperature=0.0), stop_token_ids=stop_ids
    )
    return orch.submit(req).result()


def test_models_and_health(served):
    server, _, _ = served
    with urllib.request.urlopen(server.url + "/v1/models") as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny"
    with urllib.request.urlopen(server.url + "/health") as r:
        assert r.status == 200


def test_completion_with_logprobs(served):
    server, orch, tok = served
    status, out = post(
        server.url + "/v1/completions",
        {"model": "tiny", "prompt": "ls -la /tmp", "max_tokens": 12, "temperature": 0, "logprobs": 1},
    )
    assert status == 200, out
    choice = out["choices"][0]
    ref = greedy_ids(orch, tok.encode("ls -la /tmp", add_special_tokens=False), 12, [tok.eos_token_id])
    assert choice["token_ids"] == ref.tokens
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], ref.logprobs, atol=1e-6)
    body = ref.tokens[:-1] if ref.tokens[-1] == tok.eos_token_id else ref.tokens
    assert choice["text"] == tok.decode(body)
    assert out["usage"]["completion_tokens"] == len(ref.tokens)


def test_chat_completion_uses_the_chat_template(served):
    server, orch, tok = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "list files"}]
    status, out = post(
        server.url + "/v1/chat/completions",
        {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0.0, "logprobs": True},
    )
    assert status == 200, out
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    stop = sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id})
    ref = greedy_ids(orch, list(ids), 10, stop)
    choice = out["choices"][0]
    assert choice["token_ids"] == ref.tokens
    assert choice["message"]["role"] == "assistant"
    got = [c["logprob"] for c in choice["logprobs"]["content"]]
    np.testing.assert_allclose(got, ref.logprobs, atol=1e-6)
    assert out["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_equals_non_streaming(served, route):
    server, _, _ = served
    body = {"model": "tiny", "max_tokens": 14, "temperature": 0.9, "seed": 4}
    body.update(
        {"prompt": "echo hi"} if "chat" not in route else {"messages": [{"role": "user", "content": "hi"}]}
    )
    status, whole = post(server.url + route, body)
    assert status == 200
    chunks = stream(server.url + route, body)
    chat = "chat" in route
    text = "".join(
        (c["choices"][0]["delta"].get("content") or "") if chat else c["choices"][0]["text"] for c in chunks
    )
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    ref = whole["choices"][0]
    assert ids == ref["token_ids"]
    assert text == (ref["message"]["content"] if chat else ref["text"])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_seeded_sampling_and_n(served):
    server, _, _ = served
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 1.0, "seed": 123, "n": 2}
    _, a = post(server.url + "/v1/completions", body)
    _, b = post(server.url + "/v1/completions", body)
    assert len(a["choices"]) == 2
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    assert a["choices"][0]["token_ids"] != a["choices"][1]["token_ids"]


def test_stop_string_truncates_text(served):
    server, _, _ = served
    body = {"prompt": "grep -rn", "max_tokens": 16, "temperature": 0}
    _, free = post(server.url + "/v1/completions", body)
    text = free["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    _, out = post(server.url + "/v1/completions", dict(body, stop=[stop]))
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == text[: text.index(stop)]


@pytest.mark.parametrize(
    "route,raw,body,status,needle",
    [
        ("/v1/completions", b"{not json", None, 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", None, 400, "JSON object"),
        ("/v1/completions", None, {"max_tokens": 3}, 400, "'prompt'"),
        ("/v1/completions", None, {"prompt": "x", "temperature": "hot"}, 400, "'temperature'"),
        ("/v1/completions", None, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", None, {"prompt": [1, 99999]}, 400, "token ids"),
        ("/v1/completions", None, {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", None, {"prompt": "x", "stop": [3]}, 400, "'stop'"),
        ("/v1/completions", None, {"prompt": list(range(300))}, 400, "max_cache_length"),
        ("/v1/chat/completions", None, {"messages": []}, 400, "'messages'"),
        ("/v1/chat/completions", None, {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("/v1/nope", None, {"prompt": "x"}, 404, "no route"),
    ],
)
def test_malformed_requests_get_4xx_and_server_stays_up(served, route, raw, body, status, needle):
    server, _, _ = served
    code, out = post(server.url + route, body, raw=raw)
    assert code == status
    assert needle in out["error"]["message"]
    code, ok = post(server.url + "/v1/completions", {"prompt": "ls", "max_tokens": 2})
    assert code == 200 and len(ok["choices"][0]["token_ids"]) >= 1


def test_serve_command_serves_a_checkpoint(ckpt, served, tmp_path):
    """``tmax-jax serve`` on a copy of the checkpoint with an MTP module, drafting 2 tokens per step:
    its greedy reply is the in-process plain engine's."""
    import shutil

    from helpers_hf import add_mtp_to_checkpoint

    spec_ckpt = tmp_path / ckpt.name
    shutil.copytree(ckpt, spec_ckpt)
    add_mtp_to_checkpoint(spec_ckpt, seed=5)
    port = 18000 + os.getpid() % 1000
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    cmd = [sys.executable, "-m", "tmax_jax", "serve", "--checkpoint", str(spec_ckpt), "--port", str(port),
           "--slots", "2", "--max-cache-length", "64", "--max-prefill-length", "32",
           "--speculative-tokens", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 240
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError(
                        f"server did not start: {proc.stdout.read().decode()[-2000:]}"
                    ) from None
                time.sleep(0.5)
        body = {"messages": [{"role": "user", "content": "pwd"}], "max_tokens": 6, "temperature": 0}
        code, out = post(url + "/v1/chat/completions", body)
        assert code == 200 and out["model"] == ckpt.name
        assert 1 <= len(out["choices"][0]["token_ids"]) <= 6
        code, plain = post(served[0].url + "/v1/chat/completions", body)
        assert code == 200 and out["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    finally:
        proc.terminate()
        proc.wait(30)

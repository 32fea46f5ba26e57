"""The LLM task generator: against the project's own server with a tiny random model (garbage
output: every task is dropped with a recorded reason, nothing is written), and the parse ->
validate -> retry-with-feedback path with a scripted endpoint standing in for a capable LLM."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from helpers_hf import make_tiny_hf_checkpoint

from tmax_jax.cli import main
from tmax_jax.sandbox import SandboxConfig
from tmax_jax.tasks import load_task
from tmax_jax.tasks.filter import check_task
from tmax_jax.tasks.generator.llm import Drop, LLMGenerator, Written


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from tmax_jax.checkpoints import load_hf
    from tmax_jax.engine import Engine, Orchestrator
    from tmax_jax.engine.server import OpenAIServer
    from tmax_jax.tokenizer import load_tokenizer

    ckpt = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), tokenizer=True, vocab_size=512)
    tok = load_tokenizer(ckpt)
    engine = Engine(load_hf(ckpt), max_concurrent_decodes=2, max_cache_length=1024, tokenizer=tok)
    with Orchestrator(engine) as orch:
        server = OpenAIServer(orch, tok, model_name="tiny", port=0)
        server.start()
        try:
            yield f"{server.url}/v1"
        finally:
            server.shutdown()


def test_garbage_model_output_drops_every_task_and_writes_none(tiny_server, tmp_path):
    out = tmp_path / "corpus"
    rc = main(
        [
            "generate-tasks",
            "--generator",
            "llm",
            "--llm-url",
            tiny_server,
            "--model",
            "tiny",
            "--n",
            "1",
            "--out",
            str(out),
            "--retries",
            "1",
            "--max-tokens",
            "24",
        ]
    )
    assert rc == 0
    report = json.loads((out / "generation_report.json").read_text())
    assert report["kept"] == 0 and len(report["tasks"]) == 1
    for t in report["tasks"]:
        assert not t["kept"] and t["reason"].startswith("template: ") and len(t["reason"]) > len("template: ")
    assert sorted(p.name for p in out.iterdir()) == ["generation_report.json"]  # no task, no partial dir


GOOD = {
    "template": '{"prompt": "Create /home/user/out.txt containing the word ready and nothing else.", "truth": "ready"}',
    "initial_test": "```python\nfrom pathlib import Path\n\ndef test_no_output():\n    assert not Path('/home/user/out.txt').exists()\n\ndef test_seed():\n    assert Path('/home/user/seed.txt').read_text() == 'x\\n'\n```",
    "final_test": "```python\nfrom pathlib import Path\n\ndef test_out():\n    assert Path('/home/user/out.txt').read_text().strip() == 'ready'\n```",
    "setup": "```bash\nmkdir -p /home/user\necho x > /home/user/seed.txt\n```",
}
BAD = {
    "template": "Sure! Here is a task: make a file.",
    "initial_test": "```python\ndef test_x(:\n    pass\n```",
    "final_test": "```python\nprint('no tests here')\n```",
    "setup": "```bash\nif then fi\n```",
}


class _Scripted(BaseHTTPRequestHandler):
    """Answers each stage wrongly first, then rightly; records every request."""

    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        ask = body["messages"][-1]["content"]
        stage = (
            next(
                s
                for s, key in (
                    ("template", "JSON object"),
                    ("initial_test", "test_initial_state"),
                    ("final_test", "test_final_state"),
                    ("setup", "setup.sh"),
                )
                if key in ask
            )
            if "invalid" not in ask
            else None
        )
        if stage is None:  # a retry: answer the stage the previous request asked for, correctly
            prev = next(
                m["content"]
                for m in reversed(body["messages"])
                if m["role"] == "user" and "invalid" not in m["content"]
            )
            stage = next(
                s
                for s, key in (
                    ("template", "JSON object"),
                    ("initial_test", "test_initial_state"),
                    ("final_test", "test_final_state"),
                    ("setup", "setup.sh"),
                )
                if key in prev
            )
            text = GOOD[stage]
        else:
            text = BAD[stage]
        data = json.dumps(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_malformed_answers_are_retried_with_the_error_and_the_task_is_executable(tmp_path):
    _Scripted.requests = []
    srv = HTTPServer(("127.0.0.1", 0), _Scripted)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        gen = LLMGenerator(f"http://127.0.0.1:{srv.server_port}/v1", "scripted", retries=1)
        got = gen.generate_one(tmp_path / "c", seed=0, index=0)
        none = LLMGenerator(f"http://127.0.0.1:{srv.server_port}/v1", "scripted", retries=0).generate_one(
            tmp_path / "d", 0, 1
        )
    finally:
        srv.shutdown()
    assert isinstance(got, Written)
    feedback = [m["content"] for r in _Scripted.requests for m in r["messages"] if "invalid" in m["content"]]
    assert any("JSON" in f for f in feedback) and any("compile" in f for f in feedback)
    assert any("no pytest test function" in f for f in feedback) and any(
        "bash syntax error" in f for f in feedback
    )
    task = load_task(got.path)
    assert task.signature and "ready" in task.instruction
    r = check_task(got.path, SandboxConfig(cache_dir=str(tmp_path / "cache")))
    assert r.kept, r.reason  # builds, initial state passes (no reference solution to run)
    assert isinstance(none, Drop) and none.stage == "template"
    assert not (tmp_path / "d").exists() or list((tmp_path / "d").iterdir()) == []


def test_unreachable_endpoint_is_a_recorded_drop(tmp_path):
    got = LLMGenerator("http://127.0.0.1:9/v1", "x", timeout_s=5).generate_one(tmp_path, 0, 0)
    assert isinstance(got, Drop) and "endpoint error" in got.reason
    assert list(Path(tmp_path).iterdir()) == []

"""`tmax-jax init-tiny` and `tmax-jax generate`: the offline first run of a new user."""

import json

import numpy as np
import pytest
from helpers_hf import hf_logits, load_hf_torch

from tmax_jax.checkpoints import load_hf
from tmax_jax.cli import main
from tmax_jax.engine import generate
from tmax_jax.tokenizer import load_tokenizer

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["init-tiny", str(out), "--seed", "3"]) == 0
    return out


def test_init_tiny_writes_a_checkpoint_transformers_and_we_agree_on(tiny_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_dir / name).is_file(), name
    cfg = json.loads((tiny_dir / "config.json").read_text())
    tok = load_tokenizer(tiny_dir)
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert len(tok) <= cfg["vocab_size"]
    ids = np.array([tok.encode("ls -la /tmp && echo done")], np.int32)
    np.testing.assert_allclose(
        np.asarray(load_hf(tiny_dir)(ids)), hf_logits(tiny_dir, ids), atol=2e-5, rtol=2e-4
    )


def test_greedy_generate_matches_transformers_greedy_decoding(tiny_dir):
    import torch

    tok = load_tokenizer(tiny_dir)
    prompt = tok.encode("cat README.md | head")
    ours = generate(load_hf(tiny_dir), [prompt], max_new_tokens=8, eos_token_id=[])[0].tokens
    hf = load_hf_torch(tiny_dir)
    with torch.no_grad():
        seq = hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert ours == seq[0, len(prompt) :].tolist()


def test_generate_command_prints_the_decoded_completion(tiny_dir, capsys):
    tok = load_tokenizer(tiny_dir)
    text = "cat README.md | head"
    model = load_hf(tiny_dir)
    eos = [model.config.eos_token_id, tok.eos_token_id]
    eos = [e for e in eos if e is not None]
    expected = tok.decode(generate(model, [tok.encode(text)], max_new_tokens=8, eos_token_id=eos)[0].tokens)
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(tiny_dir), "--prompt", text, "--raw", "--max-new-tokens", "8"]
    assert main(argv) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(["generate", "--checkpoint", str(tiny_dir / "nope"), "--prompt", "x"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main([*argv, "--speculative-tokens", "2"]) == 2
    assert "--speculative-tokens=2 drafts" in capsys.readouterr().err


def test_generate_command_keeps_its_compiled_programs_for_the_next_run(tiny_dir, tmp_path):
    """``tmax-jax generate`` writes the engine's prefill and decode programs to the persistent
    compilation cache, and a second run (a new process, reading them back) prints the same completion."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "xla_cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program, however fast it compiles
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's run
    argv = [sys.executable, "-m", "tmax_jax", "generate", "--checkpoint", str(tiny_dir)]
    argv += ["--prompt", "ls -la", "--raw", "--max-new-tokens", "6"]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    entries = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
    assert entries, "the engine's compiled programs were not written to the cache"
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout == first.stdout
    names = {e.split("-")[0] for e in entries}
    assert {"jit__prefill_fresh_impl", "jit__generate_block_impl"} <= names, names

"""Fitting the MTP module to a policy (train/mtp_fit.py): the distillation loss against a float64
NumPy computation of it, and a fitted module that makes a speculative engine keep more drafts while
it emits exactly the plain engine's tokens."""

import numpy as np
import pytest
from flax import nnx
from helpers_hf import add_mtp_to_checkpoint, make_tiny_hf_checkpoint

from tmax_jax.checkpoints import load_hf, load_mtp
from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams
from tmax_jax.errors import ConfigError
from tmax_jax.train.mtp_fit import fit_mtp, mtp_distill_loss, pad_rows

KW = dict(
    max_concurrent_decodes=8, max_cache_length=96, max_prefill_length=16, decode_steps=4, min_attend_bucket=32
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("fit"), seed=3)
    add_mtp_to_checkpoint(path, seed=4)
    return path


def _log_softmax64(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_distill_loss_matches_a_float64_reference(ckpt):
    """Rows of different lengths (padding), each position against the policy's distribution one
    token on: the teacher from the model's own forward, the KL and its mask in float64."""
    model, mtp = load_hf(ckpt), load_mtp(ckpt)
    rows = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 200, 17], [11, 12]]
    masks = [[0, 0, 0, 1, 1, 0, 1], [0, 1, 1, 1], [1, 1]]  # 1: tokens the policy sampled
    ids, seg, sampled = pad_rows(rows, 8, masks)
    loss, count = mtp_distill_loss(mtp, model, ids, seg)
    loss_sampled, count_sampled = mtp_distill_loss(mtp, model, ids, seg, sampled)
    teacher = np.asarray(model(ids, segment_ids=seg))  # [B, T, V] logits
    h = model.hidden_states(ids, segment_ids=seg)
    head = np.asarray(model.lm_head_weight(), np.float64)
    kls, kls_sampled = [], []
    for b, row in enumerate(rows):
        nxt = np.zeros((1, 8), np.int32)  # position i reads t_{i+1} and predicts t_{i+2}
        nxt[0, : len(row) - 1] = row[1:]
        out, _ = mtp(model.embed_tokens[...], h[b : b + 1], nxt, np.arange(8)[None], seg[b : b + 1])
        for i in range(len(row) - 1):
            log_p = _log_softmax64(teacher[b, i + 1])
            log_q = _log_softmax64(np.asarray(out[0, i], np.float64) @ head)
            kls.append(float(np.sum(np.exp(log_p) * (log_p - log_q))))
            if i + 2 < len(row) and masks[b][i + 2]:  # a draft is asked for sampled tokens only
                kls_sampled.append(kls[-1])
    assert int(count) == len(kls) == 6 + 3 + 1
    np.testing.assert_allclose(float(loss), np.mean(kls), rtol=2e-4, atol=1e-7)
    assert int(count_sampled) == len(kls_sampled) == 3 + 2
    np.testing.assert_allclose(float(loss_sampled), np.mean(kls_sampled), rtol=2e-4, atol=1e-7)


def _run(model, mtp, prompts, temperature, seed0):
    engine = Engine(model, mtp=mtp, speculative_tokens=3, **KW) if mtp is not None else Engine(model, **KW)
    reqs = [
        Request(prompt=p, max_tokens=32, sampling=SamplingParams(temperature=temperature, seed=seed0 + i))
        for i, p in enumerate(prompts)
    ]
    with Orchestrator(engine) as orch:
        outs = orch.generate(reqs)
        slot_steps, tokens = orch.take_decode_counts()
    return [o.tokens for o in outs], tokens / slot_steps


def _self_samples(model, seed: int):
    """(64 rows of 6 random prompt tokens + 32 the policy sampled at T=1, 8 test prompts, the plain
    engine's greedy tokens for them)."""
    rng = np.random.default_rng(seed)
    train = [[int(t) for t in rng.integers(0, 256, 6)] for _ in range(64)]
    samples, _ = _run(model, None, train, 1.0, 0)
    test = [[int(t) for t in rng.integers(0, 256, 6)] for _ in range(8)]
    plain, _ = _run(model, None, test, 0.0, 100)
    return [p + s for p, s in zip(train, samples)], test, plain


def test_fitted_module_keeps_more_drafts_and_the_same_tokens(ckpt):
    """The checkpoint's random module almost never guesses the greedy token; fitted on the policy's
    own samples it does most of the time (tokens per model step well above 1), and the engine still
    emits the plain engine's tokens."""
    model, mtp = load_hf(ckpt), load_mtp(ckpt)
    rows, test, plain = _self_samples(model, seed=0)
    before, per_step_before = _run(model, mtp, test, 0.0, 100)
    losses = fit_mtp(model, mtp, rows, steps=300, learning_rate=3e-3, batch_size=16)
    after, per_step_after = _run(model, mtp, test, 0.0, 100)
    assert before == plain and after == plain
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) / 4
    assert per_step_before < 1.2 and per_step_after > 1.8, (per_step_before, per_step_after)


def test_fit_settings_are_checked(ckpt):
    model, mtp = load_hf(ckpt), load_mtp(ckpt)
    with pytest.raises(ConfigError, match="steps"):
        fit_mtp(model, mtp, [[1, 2, 3]], steps=0)
    with pytest.raises(ConfigError, match="at least 3 tokens"):
        fit_mtp(model, mtp, [[1, 2, 3], [4]], steps=1)
    with pytest.raises(ConfigError, match="learning_rate"):
        fit_mtp(model, mtp, [[1, 2, 3]], steps=1, learning_rate=0.0)
    from tmax_jax.train.mtp_fit import DraftFitter

    with pytest.raises(ConfigError, match="cache_bytes must be an integer >= 0, got -1"):
        DraftFitter(model, mtp, learning_rate=1e-3, batch_size=2, seq_len=8, cache_bytes=-1)


def test_fit_mtp_command(tmp_path, capsys):
    """``tmax-jax fit-mtp`` on a checkpoint without an MTP module, from JSONL prompts and from task
    directories: the output checkpoint holds a fitted module (load_mtp reads it, its loss fell) and
    the same policy; bad input is named."""
    import json

    from harbor_helpers import write_harbor_task

    from tmax_jax.cli import main

    ckpt = make_tiny_hf_checkpoint(tmp_path / "ckpt", tokenizer=True, vocab_size=512, seed=5)
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"ls -la /tmp/{i}"} for i in range(5)]
    lines += [{"messages": [{"role": "user", "content": f"count the files in /srv/{i}"}]} for i in range(3)]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    base = ["fit-mtp", "--checkpoint", str(ckpt), "--samples", "2", "--max-new-tokens", "12", "--steps", "40",
            "--batch-size", "8", "--learning-rate", "3e-3", "--heldout", "0.25"]  # fmt: skip
    assert main([*base, "--prompts", str(prompts), "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "holds no MTP module" in out and "tokens per model step" in out
    first, last = (float(x) for x in out.split("fit-mtp: loss ")[1].split(";")[0].split(" -> "))
    assert last < first
    mtp = load_mtp(tmp_path / "a")
    assert mtp is not None and mtp.num_layers == 1
    ids = np.array([[3, 1, 4, 1, 5]])
    np.testing.assert_array_equal(np.asarray(load_hf(tmp_path / "a")(ids)), np.asarray(load_hf(ckpt)(ids)))

    tasks = tmp_path / "tasks"
    for i in range(3):
        write_harbor_task(
            tasks, f"t{i}", "files", f"Write {i} into /app/out.txt", "FROM scratch\n", "true", {}
        )
    argv = [*base, "--tasks", str(tasks), "--no-tool-schema", "--heldout", "0", "--out", str(tmp_path / "b")]
    assert main(argv) == 0
    assert "acceptance not measured" in capsys.readouterr().out
    assert load_mtp(tmp_path / "b") is not None

    assert main([*base, "--prompts", str(prompts), "--out", str(ckpt)]) == 2
    assert "must be a new or empty directory" in capsys.readouterr().err
    prompts.write_text('{"prompt": "ok"}\nnot json\n')
    assert main([*base, "--prompts", str(prompts), "--out", str(tmp_path / "c")]) == 2
    assert "prompts.jsonl:2: not JSON" in capsys.readouterr().err


def test_draft_fitter_swaps_into_a_running_engine(ckpt):
    """What a train run with engine.draft_fit_steps does between steps: DraftFitter fits the draft
    to the policy (one compiled step, data of any length cut or padded to its seq_len), and
    Engine.update_draft gives it to the engine, whose next requests keep more drafts and emit the
    plain engine's tokens. Weights of another shape are refused."""
    from tmax_jax.models.qwen35.mtp import MultiTokenPredictor
    from tmax_jax.train.mtp_fit import DraftFitter

    model, mtp = load_hf(ckpt), load_mtp(ckpt)
    rows, test, plain = _self_samples(model, seed=1)
    engine = Engine(model, mtp=mtp, speculative_tokens=3, **KW)
    fitter = DraftFitter(model, mtp, learning_rate=3e-3, batch_size=16, seq_len=24)
    reqs = [Request(prompt=p, max_tokens=32, sampling=SamplingParams(temperature=0.0)) for p in test]
    per_step = []
    with Orchestrator(engine) as orch:
        for _ in range(2):
            outs = orch.generate(reqs)
            slot_steps, tokens = orch.take_decode_counts()
            per_step.append(tokens / slot_steps)
            assert [o.tokens for o in outs] == plain
            fitter.fit(model, rows, 150)  # rows of 38 tokens, cut to 24
            engine.update_draft(fitter.module())
        outs = orch.generate(reqs)
        slot_steps, tokens = orch.take_decode_counts()
        per_step.append(tokens / slot_steps)
    assert [o.tokens for o in outs] == plain
    assert per_step[0] < 1.2 and per_step[-1] > 1.8, per_step
    with pytest.raises(ConfigError, match=r"update_draft: the MTP weights differ: .* expected"):
        engine.update_draft(MultiTokenPredictor(model.config, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ConfigError, match="does not decode speculatively"):
        Engine(model, **KW).update_draft(mtp)


def test_draft_fitter_matches_fitting_step_by_step(ckpt):
    """DraftFitter runs the frozen policy once over the rows a run of steps draws and pads them to a
    length bucket. The reference does what the loss says at every step: the policy's forward on the
    step's rows padded to seq_len, value_and_grad of mtp_distill_loss, optax's AdamW. Same draws,
    same losses and module after 6 steps, with the whole fit's rows in one forward and with no
    cache at all (a forward per run of steps whose rows fit one batch)."""
    import jax
    import optax

    from tmax_jax.train.mtp_fit import DraftFitter

    model = load_hf(ckpt)
    rng = np.random.default_rng(7)
    # One row too short to draft from, two longer than seq_len (cut), the rest padded.
    rows = [[int(t) for t in rng.integers(0, 256, n)] for n in (5, 9, 2, 30, 12, 7, 17, 40, 3, 11)]
    masks = [[int(b) for b in rng.integers(0, 2, len(r))] for r in rows]
    seq_len, batch, steps, lr = 24, 4, 6, 3e-3

    keep = [i for i, r in enumerate(rows) if len(r) >= 3]
    ids, seg, sampled = pad_rows([rows[i] for i in keep], seq_len, [masks[i] for i in keep])
    graphdef, params, rest = nnx.split(load_mtp(ckpt), nnx.Param, ...)
    start = jax.tree.map(np.asarray, params)
    opt = optax.adamw(lr, weight_decay=0.0)
    opt_state = opt.init(params)

    def loss_fn(p, pick):
        return mtp_distill_loss(nnx.merge(graphdef, p, rest), model, ids[pick], seg[pick], sampled[pick])[0]

    draw, ref, drawn = np.random.default_rng((3, 1)), [], set()
    for _ in range(steps):
        pick = draw.choice(len(keep), size=batch, replace=False)
        drawn.update(pick.tolist())
        loss, grads = jax.value_and_grad(loss_fn)(params, pick)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ref.append(float(loss))

    policy_rows = {}
    for cache_bytes in (256 << 20, 0):
        fitter = DraftFitter(
            model,
            load_mtp(ckpt),
            learning_rate=lr,
            batch_size=batch,
            seq_len=seq_len,
            cache_bytes=cache_bytes,
        )
        losses = fitter.fit(model, rows, steps, masks=masks, seed=(3, 1))
        np.testing.assert_allclose(losses, ref, rtol=1e-4)
        for got, want, first in zip(
            jax.tree.leaves(fitter.params), jax.tree.leaves(params), jax.tree.leaves(start)
        ):
            moved = np.linalg.norm(np.asarray(want) - first)
            assert moved > 0 and np.linalg.norm(np.asarray(got) - np.asarray(want)) <= 1e-3 * moved
        assert fitter.counts["steps"] == steps
        policy_rows[cache_bytes] = fitter.counts["policy_rows"]
    # All drawn rows in one forward, in whole batches (a power of two of them).
    assert policy_rows[256 << 20] == batch << (-(-len(drawn) // batch) - 1).bit_length()
    assert policy_rows[256 << 20] < policy_rows[0] <= steps * batch


@pytest.mark.parametrize("placed", ["one device", "fsdp 4 x tensor 2"])
def test_draft_fitter_state_goes_through_a_train_checkpoint(ckpt, tmp_path, placed):
    """A run that fits its draft saves the fitter's state (module and AdamW state) with each train
    checkpoint: restored into a new fitter it is bit for bit the saved one, and fitting on from it
    with a step's seed gives exactly what the uninterrupted fitter gives, on one device or with the
    policy and draft sharded over 8. A step saved without one restores None; a fitter of another
    module refuses it by name."""
    import jax

    from tmax_jax.errors import CheckpointError
    from tmax_jax.models.qwen35.mtp import MultiTokenPredictor
    from tmax_jax.rl.state import TrainCheckpointer
    from tmax_jax.sharding import MeshConfig, make_mesh
    from tmax_jax.train.mtp_fit import DraftFitter

    on = {}
    if placed != "one device":
        cfg = MeshConfig(data=1, fsdp=4, tensor=2)
        on = dict(mesh=make_mesh(cfg), rules=cfg.rules)
    model = load_hf(ckpt, **on)
    rows, _, _ = _self_samples(load_hf(ckpt), seed=2)
    kw = dict(learning_rate=3e-3, batch_size=4, seq_len=24)
    first = DraftFitter(model, load_mtp(ckpt, **on), **kw)
    first.fit(model, rows, 5, seed=(0, 1))
    saved = jax.tree.map(np.asarray, first.state())
    ck = TrainCheckpointer(tmp_path / "ck", async_save=False)
    ck.save(1, {"w": np.zeros(2, np.float32)}, {"version": 1}, force=True, draft=first.state())
    ck.save(2, {"w": np.zeros(2, np.float32)}, {"version": 2}, force=True)

    second = DraftFitter(model, load_mtp(ckpt, **on), **kw)  # the checkpoint's module, not the fitted one
    assert not all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(second.state()), jax.tree.leaves(saved))
    )
    second.load_state(ck.restore_draft(1, second.abstract_state()))
    for a, b in zip(jax.tree.leaves(second.state()), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), b)
    first.fit(model, rows, 3, seed=(0, 2))
    second.fit(model, rows, 3, seed=(0, 2))
    for a, b in zip(jax.tree.leaves(first.state()), jax.tree.leaves(second.state())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    assert ck.has_draft(1) and not ck.has_draft(2)
    assert ck.restore_draft(2, second.abstract_state()) is None
    other = DraftFitter(model, MultiTokenPredictor(model.config, 2, rngs=nnx.Rngs(0)), **kw)
    with pytest.raises(CheckpointError, match="step 1 .* does not match this run's draft module"):
        ck.restore_draft(1, other.abstract_state())
    with pytest.raises(
        ConfigError,
        match=r"DraftFitter.load_state: the state differs from the fitter's: .* is float32\[1, 32\], expected float32\[2, 32\]",
    ):
        other.load_state(first.state())
    ck.close()

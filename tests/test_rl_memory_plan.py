"""The memory plan against the bytes that really sit on each of 8 fake devices."""

import jax
import pytest
from flax import nnx

from tmax_jax.cli import main
from tmax_jax.errors import ConfigError
from tmax_jax.memory_plan import GiB, make_plan
from tmax_jax.rl.optim import make_optimizer
from tmax_jax.rl.train_step import make_model
from tmax_jax.sharding import make_mesh, optimizer_shardings, param_shardings, shard_tree
from tmax_jax.train.config import load_train_config

TINY = {
    "model": {"preset": "tiny", "dtype": "float32"},
    "mesh": {"data": 2, "fsdp": 2, "tensor": 2},
    "prompts_per_step": 4,
    "group_size": 2,  # 8 rows
    "seq_len": 64,
    "plan": {"num_devices": 8},
    "rl": {"train_step": {"micro_batches": 1, "remat": "full"}},
}


def device0_bytes(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_param_and_optimizer_bytes_match_real_shards():
    cfg = load_train_config(None, TINY)
    plan = make_plan(cfg)
    model = make_model(cfg.model.shape(), remat="none")
    params = nnx.state(model, nnx.Param)
    mesh = make_mesh(cfg.mesh)
    psh = param_shardings(params, mesh, cfg.mesh)
    placed = shard_tree(params, psh)
    opt = make_optimizer(cfg.rl.optimizer)
    osh = optimizer_shardings(opt, jax.eval_shape(opt.init, placed), psh, mesh)
    opt_state = jax.jit(opt.init, out_shardings=osh)(placed)
    assert plan.params == device0_bytes(placed)
    assert plan.optimizer == device0_bytes(opt_state)
    assert plan.grads == plan.params
    assert plan.num_params == sum(x.size for x in jax.tree.leaves(params))
    assert plan.params < sum(x.nbytes for x in jax.tree.leaves(params)) / 2  # really sharded


def test_activations_grow_with_the_per_device_batch():
    small = make_plan(load_train_config(None, TINY))
    double = make_plan(load_train_config(None, TINY | {"prompts_per_step": 8}))
    assert small.local_rows == 2 and double.local_rows == 4
    assert small.activations_resident > 0 and small.activations_transient > 0
    # Per-row buffers double; batch-independent ones (weights cast for the backward) do not.
    assert 1.3 < double.activations_resident / small.activations_resident <= 2.0
    no_remat = make_plan(load_train_config(None, TINY | {"rl": {"train_step": {"remat": "none"}}}))
    assert no_remat.activations_resident > small.activations_resident  # remat keeps less


def test_remat_layers_plan_sits_between_full_and_none():
    """remat="layers" keeps every layer's two inputs for the whole backward pass (more resident than
    "full", far less than no remat) and, while a layer recomputes, its internals only (no period's
    worth of layer inputs on top, as "full" has)."""
    plans = {
        remat: make_plan(
            load_train_config(None, TINY | {"rl": {"train_step": {"micro_batches": 1, "remat": remat}}})
        )
        for remat in ("none", "full", "layers")
    }
    res = {k: p.activations_resident for k, p in plans.items()}
    assert res["full"] < res["layers"] < res["none"], res
    assert plans["layers"].activations_transient < plans["full"].activations_transient


@pytest.mark.parametrize("form", ["positional", "option"])
def test_plan_command_prints_the_table(tmp_path, capsys, form):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model: {preset: tiny}\nmesh: {fsdp: -1}\nprompts_per_step: 2\ngroup_size: 4\nseq_len: 32\n"
        "plan: {num_devices: 8, device_memory_gib: 1}\n"
    )
    where = [str(cfg)] if form == "positional" else ["--config", str(cfg)]
    assert main(["plan", *where, "--set", "seq_len=48", "--set", "plan.device_name=H200"]) == 0
    out = capsys.readouterr().out
    for word in ("params", "gradients", "optimizer", "activations resident", "total", "fits"):
        assert word in out
    assert "8 rows (2 prompts x group 4) x 48 tokens" in out and "fsdp=8" in out and "8 x H200" in out


def test_plan_command_rejects_the_old_schema(tmp_path, capsys):
    cfg = tmp_path / "old.yaml"
    cfg.write_text("model: {preset: tiny}\nbatch: {rows: 8, seq_len: 32}\n")
    assert main(["plan", str(cfg)]) == 2
    assert "unknown config key 'batch'" in capsys.readouterr().err


def test_plan_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="plan.num_devicez"):
        load_train_config(None, {"plan": {"num_devicez": 3}})
    with pytest.raises(ConfigError, match="model.overrides.hidden_sise"):
        make_plan(load_train_config(None, {"model": {"overrides": {"hidden_sise": 3}}}))
    assert GiB == 2**30


def test_plan_defaults_to_the_devices_jax_sees():
    plan = make_plan(load_train_config(None, {"prompts_per_step": 4, "group_size": 2, "seq_len": 32}))
    assert plan.mesh_shape == {"data": 1, "fsdp": jax.device_count(), "tensor": 1}
    assert plan.local_rows == 1 and plan.device_memory is None


def _rules(sequence):
    from tmax_jax.sharding import DEFAULT_RULES

    return [[k, sequence if k == "sequence" else v] for k, v in DEFAULT_RULES]


def test_sequence_rule_divides_the_activations_that_grow_with_the_row():
    """tensor=2 with the sequence rule (the default) against it mapped to None: what grows with the
    row is split in two, except the [rows, T, D] buffers every device of the tensor group holds whole
    (the head's hidden states; a layer's gathered projection inputs)."""
    long = TINY | {"seq_len": 512}
    on = make_plan(load_train_config(None, long))
    off = make_plan(load_train_config(None, long | {"mesh": TINY["mesh"] | {"rules": _rules(None)}}))
    assert (on.sequence_split, on.internals_split) == (2, True)
    assert (off.sequence_split, off.internals_split) == (1, False)
    assert on.params == off.params and on.optimizer == off.optimizer
    assert 0.5 < on.activations_resident / off.activations_resident < 0.8
    assert 0.5 < on.activations_transient / off.activations_transient < 0.8


def test_sequence_rule_needs_a_divisible_seq_len():
    with pytest.raises(ConfigError, match="seq_len=63 is not divisible by mesh.tensor=2"):
        make_plan(load_train_config(None, TINY | {"seq_len": 63}))
    # Off, any length plans (activations whole, as before).
    off = load_train_config(None, TINY | {"seq_len": 63, "mesh": TINY["mesh"] | {"rules": _rules(None)}})
    assert make_plan(off).sequence_split == 1


def test_heads_that_do_not_divide_keep_the_internals_whole():
    # tiny has 2 key heads: tensor=4 splits tokens, but the rules leave the delta rule's heads whole.
    cfg = TINY | {"mesh": {"data": 1, "fsdp": 2, "tensor": 4}, "prompts_per_step": 2}
    plan = make_plan(load_train_config(None, cfg))
    assert (plan.sequence_split, plan.internals_split) == (4, False)

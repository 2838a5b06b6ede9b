"""LoRA RL on the trainer's side (issue 64, points 3 and 4): the state trains the adapters only and
passes the frozen base through the donated step uncopied; π_ref is the base (adapters zero); bounded
staleness, R3 and the KL path run under LoRA; checkpoints hold the adapters, resume bitwise, refuse
another base and are several times smaller than a full fine-tune's."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train import _metrics, minibatch

from gspo_jax import context, lora
from gspo_jax import iteration as iteration_lib
from gspo_jax import model as model_lib
from gspo_jax import run as run_lib
from gspo_jax.built import build
from gspo_jax.checkpoint import Checkpointer
from gspo_jax.config import base_config
from gspo_jax.validation import ConfigError


def lora_config(rank=4, **lora_keys):
    """The tiny preset with one MoE stack of two layers of four experts, LoRA on, no warm start, a KL
    term (so a reference policy)."""
    c = base_config("gspo", "tiny")
    c.loss.kl_coef = 0.05
    c.model.update(num_layers=2, dense_layers=(), num_experts=4)
    c.lora.update(rank=rank, **lora_keys)
    c.warm_start.steps = 0
    return c


class LoraSetup:
    """A LoRA run's context and state, as `run.py` sets them up; `minibatch` (test_train) reads these."""

    def __init__(self, config):
        self.config, self.built = config, build(config)
        self.ctx, self.base = context.set_up(self.built)
        self.programs = self.ctx.programs
        self.mb_size = self.built.batch_size // config.train.minibatches

    @property
    def params(self):  # `minibatch` scores with it: the policy at its start is the base
        return self.state.policy


def _kinds(state) -> set[type]:
    return {type(v) for _, v in state.flat_state()}


def _base_logp(s: LoraSetup, base, tokens, positions):
    """The base model's (LoRA off) own scoring of the tokens."""
    score = jax.jit(model_lib.score, static_argnums=(0, 1))
    return score(s.ctx.base_graphdef, s.built.plan.scoring_temperature, base, tokens, positions)[0]


def test_lora_is_off_by_default_and_refused_with_a_critic():
    assert not build(base_config("gspo", "tiny")).plan.lora
    assert build(lora_config()).plan.lora
    # The warm start trains the base alone: its cache is shared with the same model's runs without LoRA.
    assert build(lora_config(rank=8)).warm_start_key == build(lora_config(rank=0)).warm_start_key
    c = base_config("ppo", "tiny")
    c.lora.rank = 4
    with pytest.raises(ConfigError, match=r"config\.lora\.rank.*critic"):
        build(c)


def test_lora_state_trains_adapters_only_and_the_base_passes_through_uncopied():
    """The state's `params` are the adapters and its optimizer state covers them only; the frozen base
    comes out of the donated step bitwise and in the same buffers; the policy at the start, and π_ref
    (adapters zero), score exactly as the base model does; the step moves the adapters."""
    s = LoraSetup(lora_config())
    s.state = s.ctx.start(s.base)  # the state takes the base: `s.base` is not used after this
    state = s.state
    assert _kinds(state.params) == {nnx.LoRAParam} and nnx.LoRAParam not in _kinds(state.frozen)
    n_adapters = sum(x.size for x in jax.tree.leaves(state.params))
    n_base = sum(x.size for x in jax.tree.leaves(state.frozen))
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
    assert n_opt <= 2 * n_adapters + 8 < n_base  # AdamW's two moments of the adapters, counters
    batch = minibatch(s)
    tokens_positions = (batch.tokens, batch.positions)
    base_copy = jax.tree.map(np.array, state.frozen)  # copies: a numpy view of a buffer blocks its donation
    logp_base = _base_logp(s, state.frozen, *tokens_positions)
    logp_policy = s.programs.score(state.policy, *tokens_positions)[0]
    logp_ref = s.programs.score(s.ctx.reference_policy(state), *tokens_positions)[0]
    np.testing.assert_allclose(logp_policy, logp_base, rtol=0, atol=1e-6)  # B = 0: the base exactly
    np.testing.assert_array_equal(logp_ref, logp_policy)  # π_ref: the same base, adapters zero
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state.frozen)]
    adapters_before = jax.tree.map(np.array, state.params)
    new, metrics, _ = s.programs.train_step(state, jax.device_put(batch, s.programs.batch_shardings))
    assert np.isfinite(float(metrics["loss"].compute())) and float(metrics["grad_norm"].compute()) > 0
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(new.frozen)] == pointers  # aliased, not copied
    for a, b in zip(jax.tree.leaves(base_copy), jax.tree.leaves(new.frozen), strict=True):
        np.testing.assert_array_equal(a, b)
    new, _, _ = s.programs.train_step(new, jax.device_put(batch, s.programs.batch_shardings))  # lr 0 at update 0
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(adapters_before), jax.tree.leaves(new.params))]
    assert any(moved)  # the Bs (A gets a gradient once B is not zero)


def test_lora_reference_is_the_base_under_a_cast_base():
    """With `lora.base_dtype` the base is stored in bfloat16; π_ref (adapters zero) scores exactly as the
    base model on the cast base does."""
    s = LoraSetup(lora_config(base_dtype="bfloat16"))
    s.state = s.ctx.start(s.base)
    assert {x.dtype for x in jax.tree.leaves(s.state.frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(s.state.params)} == {jnp.dtype(jnp.float32)}
    batch = minibatch(s)
    base_graphdef = model_lib.abstract_model(
        dataclasses.replace(s.built.model, lora=lora.LoraConfig(), param_dtype="bfloat16")
    )[0]
    score = jax.jit(model_lib.score, static_argnums=(0, 1))
    t = s.built.plan.scoring_temperature
    logp_base = score(base_graphdef, t, s.state.frozen, batch.tokens, batch.positions)[0]
    logp_ref = s.programs.score(s.ctx.reference_policy(s.state), batch.tokens, batch.positions)[0]
    np.testing.assert_allclose(logp_ref, logp_base, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_lora_runs_with_staleness_r3_and_kl_resumes_bitwise_and_refuses_another_base(tmp_path, monkeypatch):
    """A LoRA run with bounded staleness k = 1, R3 and a KL term: ratio 1 and KL 0 at the first update,
    finite metrics, stale drift logged; interrupted and resumed it continues bitwise; resumed on another
    base (a bfloat16 cast) it is refused in one line; its checkpoint is several times smaller than the
    full fine-tune's of the same model."""
    c = lora_config()
    c.rollout.staleness = 1
    c.train.update(routing_replay="R3", minibatches=1, num_iterations=3)
    built = build(c)
    run_lib.train_and_evaluate(built, tmp_path / "full", progress=False)
    rows = _metrics(tmp_path / "full")
    first, third = rows[1], rows[3]  # the first update's learning rate is 0: iteration 2 samples with it
    for k in ("ratio_min", "ratio_max"):  # π_old is today's policy: the same forward, two programs
        assert first[k] == pytest.approx(1.0, abs=1e-5), k
    assert abs(first["kl_ref"]) < 1e-6  # π_θ = π_ref = the base at the start
    assert third["ratio_min"] < 1.0 < third["ratio_max"] and third["kl_ref"] > 0  # one iteration stale
    assert third["policy_lag"] == 1.0 and "stale_slot_change_rate" in third
    for r in rows[1:]:
        for k in ("loss", "grad_norm", "drift_slot_change_rate", "mismatch_kl_k3", "approx_kl"):
            assert np.isfinite(r[k]), (k, r[k])

    # Killed in its last iteration, as by kill -9 (no stop, no save; checkpoints every iteration at tiny):
    # the rerun resumes from the adapters, their optimizer state and the stale-policy queue of step 2.
    original = iteration_lib.rl_iteration

    def killed_in_iteration_3(ctx, state, it):
        if it == 2:  # 0-based
            raise RuntimeError("the machine died")
        return original(ctx, state, it)

    with monkeypatch.context() as m, pytest.raises(RuntimeError, match="died"):
        m.setattr(iteration_lib, "rl_iteration", killed_in_iteration_3)
        run_lib.train_and_evaluate(built, tmp_path / "resumed", progress=False)
    assert Checkpointer(tmp_path / "resumed" / "checkpoints").all_steps()[-1] == 2
    run_lib.train_and_evaluate(built, tmp_path / "resumed", progress=False)
    resumed = _metrics(tmp_path / "resumed")
    times = lambda r: {k: v for k, v in r.items() if "seconds" not in k and k not in ("time", "xla_compiles")}
    assert times(resumed[-1]) == times(third)  # bitwise, times aside

    c.lora.base_dtype, c.train.num_iterations = "bfloat16", 4
    with pytest.raises(ConfigError, match="LoRA base differs from this run's: hash"):
        run_lib.train_and_evaluate(build(c), tmp_path / "resumed", progress=False, allow_config_change=True)

    # A full fine-tune's checkpoint holds at least the float32 policy and AdamW's two moments of it (and,
    # at staleness 1, the lagged policy): 3 x 4 bytes per parameter is a floor on its size.
    size = lambda d: sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())
    params, _ = model_lib.count_params(build(lora_config(rank=0)).model)
    lora_bytes, full_bytes = size(tmp_path / "full/checkpoints/2"), 12 * params
    assert full_bytes > 3 * lora_bytes, (full_bytes, lora_bytes)


@pytest.mark.slow
def test_lora_runs_with_r3w_rspo_and_the_off_policy_mask(tmp_path):
    """Weight replay (R3W: the sampler's gates recorded and replayed), RSPO's router-shift weight from
    π_old's router log-probs (off the on-policy path: two minibatches) and the off-policy mask, under
    LoRA: finite metrics, and the first minibatch starts at ratio 1 (the base, B = 0)."""
    c = lora_config()
    c.train.update(routing_replay="R3W", minibatches=2, num_iterations=2)
    c.loss.update(router_shift=True, off_policy_mask_delta=0.5)
    run_lib.train_and_evaluate(build(c), tmp_path, progress=False)
    rows = _metrics(tmp_path)
    for r in rows[1:]:
        for k in ("loss", "grad_norm", "drift_slot_change_rate", "ratio_mean", "kl_ref"):
            assert np.isfinite(r[k]), (k, r[k])
    assert rows[1]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # lr 0 at update 0: both minibatches at π_old


def test_a_lora_runs_checkpoints_are_not_read_as_whole_snapshots(tmp_path):
    """A LoRA run's checkpoints hold adapters only: the snapshot tools (drift, export) refuse it in one
    line rather than restoring adapters as if they were the policy."""
    from gspo_jax import snapshots
    from gspo_jax.config import as_json

    c = base_config("gspo", "tiny")
    c.lora.rank = 4
    (tmp_path / snapshots.CONFIG_FILE).write_text(as_json(c))
    with pytest.raises(ConfigError, match=r"LoRA run \(lora.rank=4\).*not supported yet") as e:
        snapshots.open_run(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_the_lora_benchmark_reports_both_ratios(tmp_path):
    """`python -m benchmarks.lora` at the tiny size: both programs timed for both policies, their ratios
    finite, the adapters the only trained parameters (nothing here is judged by speed)."""
    from benchmarks import lora as bench

    out = bench.main(["--size", "tiny", "--rank", "4", "--repeats", "1", "--out", str(tmp_path / "lora.json")])
    assert json.loads((tmp_path / "lora.json").read_text())["rank"] == 4
    for name in ("train_step", "sample"):
        assert all(t > 0 for t in out[name]["best"].values()) and np.isfinite(out[name]["ratio"]), out[name]
    # The adapters add matmul work in both programs; the step saves the base's weight gradients.
    assert out["sample"]["flops_ratio"] > 1.0 and out["full"]["train_flops"] > 0
    assert (
        out["full"]["trained_params"]
        == out["full"]["policy_params"]
        == out["lora"]["policy_params"] - (out["lora"]["trained_params"])
    )


@pytest.mark.slow
def test_a_lora_plan_compiles_for_a_one_host_slice():
    """The one-host recipe's plan (docs/TPU.md) at a size CI compiles in seconds: the flagship's structure
    (scanned, rematerialised, bf16, grouped expert kernels) with LoRA rank 4 on attention + experts and a
    bfloat16 base, for a v5p:2x2x1 slice on an FSDP-only mesh: train step, scoring and sampler fit."""
    from test_aot import FLAGSHIP_DIMS, FLAGSHIP_SHAPE

    from gspo_jax import aot

    c = base_config("gspo", "qwen3_30b_a3b")
    c.model.update(**FLAGSHIP_DIMS)
    c.prompt_len, c.max_new_tokens = FLAGSHIP_SHAPE["prompt_len"], FLAGSHIP_SHAPE["max_new_tokens"]
    c.rollout.update(num_groups=FLAGSHIP_SHAPE["rollout.num_groups"], group_size=FLAGSHIP_SHAPE["rollout.group_size"])
    c.mesh.update(fsdp=-1, expert=1)
    c.lora.update(rank=4, targets=("attention", "experts"), base_dtype="bfloat16")
    with jax.default_matmul_precision("default"):  # as scripts/aot_compile.py compiles (conftest: highest)
        rows = aot.compile_report(c, "v5p:2x2x1")
    assert [(r.program, r.mesh) for r in rows] == [(p, "fsdp=4") for p in aot.PROGRAMS]
    assert all(r.fits and r.argument_bytes > 0 for r in rows), rows

    # Split 2 + 2 (`mesh.rollout_devices`): the sampler's chips hold the base's copy and the lagged adapters.
    c.rollout.staleness, c.mesh.rollout_devices = 2, 2
    c.mesh.rollout.update(data=1, fsdp=-1)
    with jax.default_matmul_precision("default"):
        split = aot.compile_report(c, "v5p:2x2x1", programs=("sample",))
    [sample] = split
    assert sample.mesh == "sampler fsdp=2" and sample.fits and sample.chips == 2
    _, abstract = model_lib.abstract_model(build(c, device_count=4).model)
    adapters, base = lora.split(abstract)
    shard = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)) / 2  # all split in 2
    assert sample.resident_bytes == pytest.approx(2 * shard(adapters), rel=0.05)  # k = 2 lagged adapters, no base
    assert sample.argument_bytes > shard(base)  # the base's copy is the sampler's argument, not part of the lag

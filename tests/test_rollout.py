"""Rollout: fixed shapes, dynamic sampling, zero-weight fill, overlong shaping and filtering."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gspo_jax import model as model_lib
from gspo_jax import model_config, sharding
from gspo_jax.advantages import overlong_penalty
from gspo_jax.algorithms import ALGORITHMS
from gspo_jax.evaluate import SAMPLED_KEY_OFFSET, evaluate
from gspo_jax.losses import policy_loss
from gspo_jax.rollout import Rollout, RolloutBatch, RolloutConfig, select_groups
from gspo_jax.sampler import SampleOutput, Sampler, SamplerOptions
from gspo_jax.tasks import Example, TaskPrompts, load_tokenizer, prompt_iterator
from gspo_jax.train import TrainBatch

GROUPS, G, P, N = 4, 4, 8, 6


@dataclasses.dataclass(frozen=True)
class CoinTask:
    """Prompts 'a<k>' are rewarded by the parity of the completion's first character (informative
    groups, usually); prompts 'b<k>' always get `dead_reward` (zero-variance groups)."""

    name: str = "coin"
    dead_reward: float = 0.0

    def sample(self, rng):
        k = int(rng.integers(0, 100))
        return Example(prompt=("a" if rng.random() < 0.5 else "b") + str(k), answer="")

    def extract_answer(self, completion):
        return completion[:1] or None

    def reward(self, completion, example):
        if example.prompt.startswith("b"):
            return self.dead_reward
        return float(bool(completion) and ord(completion[0]) % 2 == 0)

    def demonstration(self, example):
        return "0"


@pytest.fixture(scope="module")
def env():
    cfg = model_config.get("tiny")
    graphdef, state = nnx.split(model_lib.Transformer(cfg, rngs=nnx.Rngs(1)))
    sampler = Sampler(graphdef, cfg, GROUPS * G, P, N)
    return state, sampler, load_tokenizer()


def make(env, task=CoinTask(), **kw):
    state, sampler, tok = env
    rcfg = RolloutConfig(num_groups=GROUPS, group_size=G, **kw)
    return Rollout(sampler, task, tok, rcfg), state, TaskPrompts(task, seed=0, split="all")


def check_shapes(batch, cfg):
    B, T = GROUPS * G, P + N
    assert batch.tokens.shape == (B, T) and batch.loss_mask.shape == (B, T) and batch.sampler_logp.shape == (B, T)
    assert batch.rewards.shape == (B,) and batch.advantages.shape == (B,) and batch.group_ids.shape == (B,)
    assert batch.topk.shape == (B, cfg.num_moe_layers, T, cfg.top_k)


def test_a_batch_array_has_one_name_and_one_placement_from_the_sampler_to_the_trainer():
    """The sampler's output, the rollout and the trainer's batch name their fields from one table, and
    place them by it: a field that passes through keeps its name, its dtype and its sharding."""
    names = lambda cls: [f.name for f in dataclasses.fields(cls)]
    sample, rollout, train = names(SampleOutput), names(RolloutBatch), names(TrainBatch)
    assert set(sample) <= set(rollout) and set(sample + rollout + train) <= set(sharding.BATCH_FIELDS)
    assert "old_logp" not in rollout and "logp" not in sample  # π_old's exists in the trainer's batch only
    spec = TrainBatch.spec(critic=False, weight_replay=True, old_router=True)
    assert spec == {k: sharding.BATCH_FIELDS[k] for k in spec}
    mesh, cfg = sharding.make_mesh(data=2, expert=2, tensor=2), model_config.get("tiny")
    graphdef, state = model_lib.abstract_model(cfg)
    sampler = Sampler(graphdef, cfg, 8, P, N, mesh=mesh, state=state, options=SamplerOptions(record_gates=True))
    by_train = TrainBatch.shardings(mesh, critic=False, weight_replay=True)
    shared = set(sample) & set(train)
    assert shared == {"tokens", "completion_mask", "sampler_logp", "topk", "gates"}
    for k in shared:
        assert getattr(sampler._out_shardings, k) == getattr(by_train, k), k


def test_select_groups_prefers_informative_groups_in_order():
    flags = [np.array([True, False, False, True]), np.array([False, True, True, True])]
    picks, weights, short = select_groups(flags, 4, dynamic=True)
    assert picks == [(0, 0), (0, 3), (1, 1), (1, 2)] and all(weights) and short == 0
    picks, weights, short = select_groups([np.array([False, True, False, False])], 3, dynamic=True)
    assert picks[0] == (0, 1) and weights == [True, False, False] and short == 2
    picks, weights, short = select_groups(flags, 4, dynamic=False)
    assert picks == [(0, g) for g in range(4)] and all(weights) and short == 0


def test_dynamic_sampling_keeps_only_informative_groups(env, compile_counter):
    rollout, state, it = make(env, dynamic_sampling=True, max_rounds=6)
    rollout(state, it, jax.random.key(1))  # compiles the sampler
    compile_counter.reset()
    batch, met = rollout(state, it, jax.random.key(0))
    assert compile_counter.count == 0  # several generation rounds, one compiled sampler
    check_shapes(batch, model_config.get("tiny"))
    r = batch.rewards.reshape(GROUPS, G)
    assert met["groups_short"] == 0 and met["groups_kept"] == GROUPS
    assert np.all(r.max(1) != r.min(1))  # no zero-variance group was kept
    assert met["generation_rounds"] >= 1 and met["groups_dropped"] >= 0
    assert np.all(batch.loss_mask == batch.completion_mask)


def test_without_dynamic_sampling_zero_variance_groups_stay_with_zero_advantage(env):
    rollout, state, it = make(env)
    batch, met = rollout(state, it, jax.random.key(1))
    r, a = batch.rewards.reshape(GROUPS, G), batch.advantages.reshape(GROUPS, G)
    const = r.max(1) == r.min(1)
    assert np.all(a[const] == 0) and met["generation_rounds"] == 1


def test_shortfall_is_filled_with_zero_weight_groups_that_leave_the_loss_unchanged(env):
    rollout, state, it = make(env, dynamic_sampling=True, max_rounds=2)
    batch, met = None, None
    for seed in range(20):  # find a draw with both kept and filled groups
        batch, met = rollout(state, it, jax.random.key(seed))
        if 0 < met["groups_short"] < GROUPS:
            break
    assert 0 < met["groups_short"] < GROUPS, met
    check_shapes(batch, model_config.get("tiny"))
    filled = np.repeat(np.arange(GROUPS) >= GROUPS - met["groups_short"], G)
    assert np.all(batch.loss_mask[filled] == 0) and np.all(batch.advantages[filled] == 0)
    logp = jnp.asarray(batch.sampler_logp) + 0.05 * jax.random.normal(jax.random.key(0), batch.sampler_logp.shape)
    for name in ("grpo", "dapo", "gspo"):
        cfg = dataclasses.replace(ALGORITHMS[name].loss, kl_coef=0.0)
        full, m_full = policy_loss(cfg, logp, batch.sampler_logp, batch.advantages, batch.loss_mask)
        kept, m_kept = policy_loss(
            cfg, logp[~filled], batch.sampler_logp[~filled], batch.advantages[~filled], batch.loss_mask[~filled]
        )
        np.testing.assert_allclose(full, kept, rtol=1e-6)
        assert float(m_full["denominator"].compute()) == float(m_kept["denominator"].compute())


def test_all_dead_prompts_fill_everything_and_report_the_shortfall(env):
    task = CoinTask()
    rollout, state, _ = make(env, task=task, dynamic_sampling=True, max_rounds=2)

    class DeadPrompts:
        def next_batch(self, n):
            return [Example(prompt="b1", answer="")] * n

    batch, met = rollout(state, DeadPrompts(), jax.random.key(0))
    assert met["groups_short"] == GROUPS and met["generation_rounds"] == 2
    assert np.all(batch.loss_mask == 0) and np.all(batch.advantages == 0)


def test_overlong_shaping_and_filtering(env):
    task = CoinTask(dead_reward=1.0)
    rollout, state, it = make(env, task=task, overlong_cache_len=4, overlong_factor=0.5, overlong_filter=True)
    batch, met = rollout(state, it, jax.random.key(2))
    texts = rollout.decode_completions(batch.tokens, batch.lengths)
    assert len(texts) == GROUPS * G
    pen = np.asarray(overlong_penalty(batch.lengths, N, 4))
    assert np.any(pen < 0)  # a random policy rarely stops: the buffer is exercised
    prompts = [rollout.tokenizer.decode(row[:P], skip_special_tokens=True) for row in batch.tokens]
    raw = np.array([task.reward(t, Example(prompt=p, answer="")) for t, p in zip(texts, prompts)])
    np.testing.assert_allclose(batch.rewards, raw + 0.5 * pen, rtol=1e-6)
    assert np.all(batch.loss_mask[batch.truncated] == 0)
    assert np.all(batch.loss_mask[~batch.truncated] == batch.completion_mask[~batch.truncated])
    assert 0 <= met["truncation_rate"] <= 1


def test_rollout_config_rejects_bad_values():
    with pytest.raises(ValueError, match="group_size"):
        RolloutConfig(group_size=0)
    with pytest.raises(ValueError, match="advantage_scale"):
        RolloutConfig(advantage_scale="std")
    with pytest.raises(ValueError, match="max_rounds"):
        RolloutConfig(dynamic_sampling=True, max_rounds=1)


def test_evaluate_reports_greedy_and_sampled_accuracy_on_fixed_prompts(env):
    """Sampled held-out accuracy is the rollout's own sampling on the greedy evaluation's prompts: near
    temperature 0 it equals the greedy accuracy, at temperature 1 it is the draws' mean reward done by
    hand, and every call sees the same prompts and keys (a run's curve moves with the policy only)."""
    cold, state, _ = make(env, temperature=1e-6)
    m_cold, samples = evaluate(cold, state, seed=3, num_batches=2)
    assert m_cold["eval_accuracy_sampled"] == m_cold["eval_accuracy"]
    rollout, state, _ = make(env)
    m, _ = evaluate(rollout, state, seed=3, num_batches=2)
    assert m == evaluate(rollout, state, seed=3, num_batches=2)[0]
    assert m["eval_accuracy"] == m_cold["eval_accuracy"]  # greedy ignores the rollout's temperature
    prompts = prompt_iterator(CoinTask(), seed=3, split="eval")
    keys = [jax.random.key(SAMPLED_KEY_OFFSET + i) for i in range(2)]
    raw = [rollout.sample(state, prompts.next_batch(GROUPS * G), 1, k, temperature=1.0).raw for k in keys]
    assert m["eval_accuracy_sampled"] == pytest.approx(np.mean(np.concatenate(raw) == 1.0))
    assert [x["prompt"] for x in samples] == [x["prompt"] for x in evaluate(rollout, state, seed=3, num_batches=2)[1]]

"""Prompts -> G samples each -> rewards -> advantages -> a fixed-shape `RolloutBatch`.

DAPO's tricks live here, outside the loss: overlong reward shaping, overlong filtering (truncated
completions leave the loss), and dynamic sampling (groups whose rewards are all equal are dropped and
new prompts are sampled, up to `max_rounds` generation rounds; a batch still short is filled with
zero-weight groups — loss mask 0, advantage 0 — which change neither the loss nor its denominator).
Shapes never change, so nothing recompiles. Shape letters: `gspo_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gspo_jax import advantages as adv_lib
from gspo_jax import multihost
from gspo_jax import sharding as sharding_lib
from gspo_jax.sampler import SampleOutput, Sampler, left_pad
from gspo_jax.validation import check, check_choice, check_int, check_number


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How a batch of num_groups × group_size completions is drawn and scored."""

    num_groups: int = 8
    group_size: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    advantage_scale: str = "group"
    advantage_eps: float = 1e-6
    dynamic_sampling: bool = False
    max_rounds: int = 1  # generation rounds per batch (dynamic sampling draws new prompts each round)
    overlong_filter: bool = False
    overlong_cache_len: int = 0  # DAPO's L_cache; 0 turns shaping off. L_max is max_new_tokens.
    overlong_factor: float = 1.0
    # The sampler's compute dtype, as an inference engine's may differ from the trainer's ("" = the
    # model's): the sampler–trainer mismatch (`mismatch_*` metrics) then is real, not zero.
    dtype: str = ""
    # The batch is generated as this many equal slices at once, one host thread each (`Sampler`): on
    # a CPU, where a decode step's small ops keep one core busy, 2 threads sample about 1.5× faster on
    # 2 cores. Each slice draws its own random stream, so this is part of what a seed gives (never
    # the machine's core count). One device only. 0: 2 on a one-device mesh when the batch is even,
    # else 1 (`threads`).
    sampler_threads: int = 0
    # Bounded staleness: iteration i samples with the policy of k iterations before today's (the
    # warm start while there is none that old), as an asynchronous trainer with max_staleness = k
    # would; that policy is π_old. 0: on-policy. Holds k parameter copies on the device (`staleness`).
    staleness: int = 0

    def __post_init__(self):
        own = "RolloutConfig"
        for f in ("num_groups", "max_rounds"):
            check_int(own, f, getattr(self, f), low=1)
        check_int(own, "staleness", self.staleness, low=0)
        check_int(own, "sampler_threads", self.sampler_threads, low=0)
        # A group of one has advantage 0 whatever its reward: nothing would be learned.
        check_int(own, "group_size", self.group_size, low=2)
        batch = self.num_groups * self.group_size
        allowed = f"a divisor of num_groups×group_size={batch}"
        check(batch % max(self.sampler_threads, 1) == 0, own, "sampler_threads", self.sampler_threads, allowed)
        check_choice(own, "advantage_scale", self.advantage_scale, adv_lib.SCALES)
        check_number(own, "advantage_eps", self.advantage_eps, low=0.0)
        check_int(own, "overlong_cache_len", self.overlong_cache_len, low=0)
        check_number(own, "overlong_factor", self.overlong_factor, low=0.0)
        # Greedy rollouts make every sample of a group identical: advantage 0 everywhere.
        check_number(own, "temperature", self.temperature, low=0.0, strict=True)
        check_int(own, "top_k", self.top_k, low=0)
        check_number(own, "top_p", self.top_p, low=0.0, high=1.0, strict=True)
        check_choice(own, "dtype", self.dtype, ("", "float32", "bfloat16"))
        if self.dynamic_sampling:
            allowed = ">= 2 with dynamic_sampling (one round can only drop groups, never replace them)"
            check(self.max_rounds >= 2, own, "max_rounds", self.max_rounds, allowed)

    def threads(self, devices: int) -> int:
        """The sampler's host threads on a mesh of `devices` devices (`sampler_threads`, 0 resolved)."""
        if self.sampler_threads:
            return self.sampler_threads
        return 2 if devices == 1 and self.num_groups * self.group_size % 2 == 0 else 1


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """One training batch of B = num_groups × group_size completions over T = P + C positions.

    Per-token fields stay where the sampler left them: device arrays, split over the sampler's mesh
    (each process holds its rows; nothing goes through the host) by the batch field table
    (`sharding.BATCH_FIELDS`), whose names they keep from the sampler to the trainer's batch.
    Per-sequence fields are host arrays, the same on every process.
    """

    tokens: jax.Array  # int32 [B, T]
    prompt_mask: jax.Array  # bool [B, T]
    completion_mask: jax.Array  # bool [B, T]: every generated token up to EOS (positions need it)
    loss_mask: jax.Array  # float32 [B, T]: completion_mask minus filtered (overlong, fill) completions
    sampler_logp: jax.Array  # float32 [B, T]: the sampler's log-probs
    topk: jax.Array  # int32 [B, L, T, K]: the sampler's routing (R3 replay)
    rewards: np.ndarray  # float32 [B], after overlong shaping
    advantages: np.ndarray  # float32 [B]
    group_ids: np.ndarray  # int32 [B]: the prompt each completion answers, unique within the batch
    lengths: np.ndarray  # int32 [B]
    truncated: np.ndarray  # bool [B]
    gates: jax.Array | None = None  # float32 [B, L, T, K]: the sampler's combine weights (R3W replay)


# The per-token sampler outputs a batch is assembled from, in this order (and "gates" when recorded);
# the per-sequence ones come through the host.
_TOKEN_FIELDS = ("tokens", "prompt_mask", "completion_mask", "sampler_logp", "topk", "gates")


class Sampled(NamedTuple):
    """One call of the sampler, scored: the output on the device, per-sequence results on the host
    (every process has all of them; each scored its own rows)."""

    out: SampleOutput
    raw: np.ndarray  # float32 [B]: the task's rewards
    lengths: np.ndarray  # int32 [B]
    truncated: np.ndarray  # bool [B]
    texts: list[str]  # the completions of this process's rows (`Rollout.rows`), decoded


class _Round(NamedTuple):
    """One generation round: G samples of each of num_groups prompts, scored."""

    sampled: Sampled
    rewards: np.ndarray  # float32 [B]: after overlong shaping
    informative: np.ndarray  # bool [num_groups]: rewards not all equal


def _pick(acc, src, rows_B, take_B):
    """`acc` with row b replaced by `src[rows_B[b]]` where `take_B[b]` (one round's picks)."""
    where = lambda a, s: jnp.where(take_B.reshape(-1, *([1] * (a.ndim - 1))), s[rows_B], a)
    return jax.tree.map(where, acc, src)


# The reward-side maths runs on host arrays once per round: one compiled program each, not one compile
# per jnp op on first use (about a second of a run's first iteration).
_informative_groups = jax.jit(adv_lib.informative_groups, static_argnums=1)
_overlong_penalty = jax.jit(adv_lib.overlong_penalty, static_argnums=(1, 2))
_group_advantages = jax.jit(adv_lib.group_advantages, static_argnums=(1, 2, 3))


def _loss_mask(completion_mask_BT, keep_B):
    return (completion_mask_BT & keep_B[:, None]).astype(jnp.float32)


def select_groups(informative_per_round: Sequence[np.ndarray], num_groups: int, dynamic: bool):
    """Which (round, group) pairs fill the batch, and which of them carry weight.

    Without dynamic sampling: the first round's groups, all weighted. With it: informative groups in
    the order they were drawn; if fewer than `num_groups` exist, the rest are uninformative groups
    with weight 0. Returns (picks [(round, group)], weights [bool], shortfall).
    """
    if not dynamic:
        return [(0, g) for g in range(num_groups)], [True] * num_groups, 0
    good = [(r, g) for r, flags in enumerate(informative_per_round) for g in np.flatnonzero(flags)]
    bad = [(r, g) for r, flags in enumerate(informative_per_round) for g in np.flatnonzero(~np.asarray(flags))]
    picks = good[:num_groups]
    shortfall = num_groups - len(picks)
    return picks + bad[:shortfall], [True] * len(picks) + [False] * shortfall, shortfall


class Rollout:
    """Draws, scores and assembles a `RolloutBatch` with a compiled `Sampler` of batch num_groups×group_size."""

    def __init__(self, sampler: Sampler, task, tokenizer, cfg: RolloutConfig):
        if sampler.batch_size != cfg.num_groups * cfg.group_size:
            raise ValueError(
                f"Rollout: sampler batch {sampler.batch_size} != num_groups×group_size = "
                f"{cfg.num_groups}×{cfg.group_size}"
            )
        self.sampler, self.task, self.tokenizer, self.cfg = sampler, task, tokenizer, cfg
        self.rows = multihost.local_rows(sampler.batch_sharding(2), sampler.batch_size)  # this process's
        self._fields = tuple(f for f in _TOKEN_FIELDS if f in sampler.fields)
        if sampler.mesh is None:
            self._pick, self._loss_mask = jax.jit(_pick), jax.jit(_loss_mask)
        else:
            b = sharding_lib.field_shardings(sampler.mesh, self._fields)
            rep = jax.sharding.NamedSharding(sampler.mesh, jax.sharding.PartitionSpec())
            self._pick = jax.jit(_pick, in_shardings=(b, b, rep, rep), out_shardings=b)
            self._loss_mask = jax.jit(_loss_mask, out_shardings=sharding_lib.field_sharding(sampler.mesh, "loss_mask"))
        self.eos_ids = (tokenizer.eos_token_id,)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def encode_prompts(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        bos = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
        ids = [bos + self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        for p, i in zip(prompts, ids):
            if len(i) > self.sampler.prompt_len:
                raise ValueError(f"prompt of {len(i)} tokens exceeds prompt_len={self.sampler.prompt_len}: {p!r}")
        return left_pad(ids, self.sampler.prompt_len, self.pad_id)

    def decode_completions(self, out_tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
        P = self.sampler.prompt_len
        return [self.tokenizer.decode(row[P : P + n], skip_special_tokens=True) for row, n in zip(out_tokens, lengths)]

    def sample(self, state, examples, repeat: int, key, *, temperature, top_k=0, top_p=1.0) -> Sampled:
        """`repeat` completions of each example (batch rows i·repeat … ), scored. Each process encodes,
        decodes and scores only the rows its devices hold; rewards and lengths are then gathered."""
        B, rows = self.sampler.batch_size, self.rows
        mine = [examples[i // repeat] for i in rows]
        tokens, mask = self.encode_prompts([ex.prompt for ex in mine])
        sh = self.sampler.batch_sharding(2)
        out = self.sampler(
            state,
            multihost.put_rows(tokens, rows, sh, B),
            multihost.put_rows(mask, rows, sh, B),
            key,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
        )
        lengths = multihost.to_local(out.lengths, rows)
        texts = self.decode_completions(multihost.to_local(out.tokens, rows), lengths)
        raw = np.array([self.task.reward(t, ex) for t, ex in zip(texts, mine)], np.float32)
        gather = functools.partial(multihost.gather_rows, rows=rows, n=B, sharding=sh)
        truncated = gather(multihost.to_local(out.truncated, rows))
        return Sampled(out, gather(raw), gather(lengths), truncated, texts)

    def _round(self, state, examples, key) -> _Round:
        cfg, G = self.cfg, self.cfg.group_size
        s = self.sample(state, examples, G, key, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        rewards = s.raw
        if cfg.overlong_cache_len > 0:
            penalty = _overlong_penalty(s.lengths, self.sampler.max_new_tokens, cfg.overlong_cache_len)
            rewards = s.raw + cfg.overlong_factor * np.asarray(penalty)
        return _Round(s, rewards.astype(np.float32), np.asarray(_informative_groups(rewards, G)))

    def __call__(self, state, prompt_iter, key) -> tuple[RolloutBatch, dict[str, float]]:
        cfg, G = self.cfg, self.cfg.group_size
        rounds = []
        for r in range(cfg.max_rounds):
            rounds.append(self._round(state, prompt_iter.next_batch(cfg.num_groups), jax.random.fold_in(key, r)))
            if not cfg.dynamic_sampling or sum(int(x.informative.sum()) for x in rounds) >= cfg.num_groups:
                break
        picks, weights, shortfall = select_groups([x.informative for x in rounds], cfg.num_groups, cfg.dynamic_sampling)
        src_round = np.repeat([r for r, _ in picks], G)
        src_row = np.concatenate([g * G + np.arange(G) for _, g in picks])
        host = lambda get: np.stack([get(rounds[r])[i] for r, i in zip(src_round, src_row)])
        weight_B = np.repeat(np.asarray(weights), G)
        truncated = host(lambda x: x.sampled.truncated)
        keep_B = weight_B & ~(truncated if cfg.overlong_filter else np.zeros_like(truncated))
        rewards = host(lambda x: x.rewards)
        advantages = _group_advantages(rewards, G, cfg.advantage_scale, cfg.advantage_eps, valid=weight_B)
        fields = self._assemble(rounds, src_round, src_row)
        B = len(src_row)
        keep = multihost.put_rows(keep_B[self.rows], self.rows, self.sampler.batch_sharding(1), B)
        batch = RolloutBatch(
            **fields,
            loss_mask=self._loss_mask(fields["completion_mask"], keep),
            rewards=rewards,
            advantages=np.asarray(advantages),
            group_ids=np.repeat(np.arange(cfg.num_groups, dtype=np.int32), G),
            lengths=host(lambda x: x.sampled.lengths),
            truncated=truncated,
        )
        return batch, self._metrics(rounds, len(picks) - shortfall, shortfall)

    def _assemble(self, rounds, src_round, src_row) -> dict[str, jax.Array]:
        """The picked rows' per-token sampler outputs, gathered on the device (one compile however many
        rounds were drawn; nothing moves when the batch is round 0 as it came)."""
        field = lambda r: {f: getattr(rounds[r].sampled.out, f) for f in self._fields}
        acc = field(0)
        if np.all(src_round == 0) and np.array_equal(src_row, np.arange(len(src_row))):
            return acc
        for r in np.unique(src_round):
            acc = self._pick(acc, field(r), src_row.astype(np.int32), src_round == r)
        return acc

    def _metrics(self, rounds, kept: int, shortfall: int) -> dict[str, float]:
        G = self.cfg.group_size
        raw = np.concatenate([x.sampled.raw for x in rounds]).reshape(-1, G)
        lengths = np.concatenate([x.sampled.lengths for x in rounds])
        n_groups = raw.shape[0]
        return {
            "reward_mean": float(np.mean(np.concatenate([x.rewards for x in rounds]))),
            "accuracy": float(np.mean(raw == 1.0)),
            "frac_all_correct": float(np.mean(np.all(raw == 1.0, axis=1))),
            "frac_all_wrong": float(np.mean(np.all(raw < 1.0, axis=1))),
            "generation_rounds": float(len(rounds)),
            "groups_kept": float(kept),
            "groups_dropped": float(n_groups - kept if self.cfg.dynamic_sampling else 0),  # fill included
            "groups_short": float(shortfall),
            "completion_len_mean": float(np.mean(lengths)),
            "completion_len_max": float(np.max(lengths)),
            "truncation_rate": float(np.mean(np.concatenate([x.sampled.truncated for x in rounds]))),
        }

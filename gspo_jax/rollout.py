"""Prompts -> G samples each -> rewards -> advantages -> a fixed-shape `RolloutBatch`.

DAPO's tricks live here, outside the loss: overlong reward shaping, overlong filtering (truncated
completions leave the loss), and dynamic sampling (groups whose rewards are all equal are dropped and
new prompts are sampled, up to `max_rounds` generation rounds; a batch still short is filled with
zero-weight groups — loss mask 0, advantage 0 — which change neither the loss nor its denominator).
Shapes never change, so nothing recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from gspo_jax import advantages as adv_lib
from gspo_jax.sampler import Sampler, left_pad


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

    def __post_init__(self):
        for f in ("num_groups", "group_size", "max_rounds"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RolloutConfig.{f}={v!r} is not allowed; it must be an int >= 1")
        if self.advantage_scale not in adv_lib.SCALES:
            raise ValueError(f"RolloutConfig.advantage_scale={self.advantage_scale!r}; choose one of {adv_lib.SCALES}")
        if not (isinstance(self.overlong_cache_len, int) and self.overlong_cache_len >= 0):
            raise ValueError(f"RolloutConfig.overlong_cache_len={self.overlong_cache_len!r}; it must be an int >= 0")
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0 or self.temperature < 0:
            raise ValueError(
                "RolloutConfig: need temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got "
                f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}"
            )
        if self.dynamic_sampling and self.max_rounds < 2:
            raise ValueError(
                "RolloutConfig.max_rounds must be >= 2 when dynamic_sampling is on "
                "(one round can only drop groups, never replace them)"
            )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "tokens",
        "prompt_mask",
        "completion_mask",
        "loss_mask",
        "old_logp",
        "ref_logp",
        "rewards",
        "advantages",
        "group_ids",
        "lengths",
        "truncated",
        "topk",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """One training batch of B = num_groups × group_size completions over L = P + N positions."""

    tokens: Any  # int32 [B, L]
    prompt_mask: Any  # bool [B, L]
    completion_mask: Any  # bool [B, L]: every generated token up to EOS (positions need it)
    loss_mask: Any  # float32 [B, L]: completion_mask minus filtered (overlong, fill) completions
    old_logp: Any  # float32 [B, L]
    ref_logp: Any  # float32 [B, L] or None (the trainer fills it when kl_coef > 0)
    rewards: Any  # float32 [B], after overlong shaping
    advantages: Any  # float32 [B]
    group_ids: Any  # int32 [B]: the prompt each completion answers, unique within the batch
    lengths: Any  # int32 [B]
    truncated: Any  # bool [B]
    topk: Any  # int32 [L_moe, B, L, k]: the sampler's routing (R3 replay)


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

    def _round(self, state, examples, key):
        cfg, G = self.cfg, self.cfg.group_size
        tokens, mask = self.encode_prompts([ex.prompt for ex in examples])
        out = self.sampler(
            state,
            np.repeat(tokens, G, 0),
            np.repeat(mask, G, 0),
            key,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
        )
        out = jax.tree.map(np.asarray, out)
        texts = self.decode_completions(out.tokens, out.lengths)
        raw = np.array([self.task.reward(t, examples[i // G]) for i, t in enumerate(texts)], np.float32)
        rewards = raw
        if cfg.overlong_cache_len > 0:
            penalty = adv_lib.overlong_penalty(out.lengths, self.sampler.max_new_tokens, cfg.overlong_cache_len)
            rewards = raw + cfg.overlong_factor * np.asarray(penalty)
        return dict(
            out=out,
            raw=raw,
            rewards=rewards.astype(np.float32),
            informative=np.asarray(adv_lib.informative_groups(rewards, G)),
        )

    def __call__(self, state, prompt_iter, key) -> tuple[RolloutBatch, dict[str, float]]:
        cfg, G = self.cfg, self.cfg.group_size
        rounds = []
        for r in range(cfg.max_rounds):
            rounds.append(self._round(state, prompt_iter.next_batch(cfg.num_groups), jax.random.fold_in(key, r)))
            if not cfg.dynamic_sampling or sum(int(x["informative"].sum()) for x in rounds) >= cfg.num_groups:
                break
        picks, weights, shortfall = select_groups(
            [x["informative"] for x in rounds], cfg.num_groups, cfg.dynamic_sampling
        )
        rows = [(r, g * G + j) for r, g in picks for j in range(G)]
        take = lambda get: np.stack([get(rounds[r])[i] for r, i in rows])  # noqa: E731
        out_field = lambda name: take(lambda x: getattr(x["out"], name))  # noqa: E731
        weight_B = np.repeat(np.asarray(weights), G)
        truncated = out_field("truncated")
        completion_mask = out_field("completion_mask")
        keep_B = weight_B & ~(truncated if cfg.overlong_filter else np.zeros_like(truncated))
        rewards = take(lambda x: x["rewards"])
        advantages = adv_lib.group_advantages(rewards, G, cfg.advantage_scale, cfg.advantage_eps, valid=weight_B)
        batch = RolloutBatch(
            tokens=out_field("tokens"),
            prompt_mask=out_field("prompt_mask"),
            completion_mask=completion_mask,
            loss_mask=(completion_mask & keep_B[:, None]).astype(np.float32),
            old_logp=out_field("logp"),
            ref_logp=None,
            rewards=rewards,
            advantages=np.asarray(advantages),
            group_ids=np.repeat(np.arange(cfg.num_groups, dtype=np.int32), G),
            lengths=out_field("lengths"),
            truncated=truncated,
            topk=np.stack([rounds[r]["out"].topk[:, i] for r, i in rows], axis=1),
        )
        return batch, self._metrics(rounds, len(picks) - shortfall, shortfall)

    def _metrics(self, rounds, kept: int, shortfall: int) -> dict[str, float]:
        G = self.cfg.group_size
        raw = np.concatenate([x["raw"] for x in rounds]).reshape(-1, G)
        lengths = np.concatenate([x["out"].lengths for x in rounds])
        n_groups = raw.shape[0]
        return {
            "reward_mean": float(np.mean(np.concatenate([x["rewards"] for x in rounds]))),
            "accuracy": float(np.mean(raw == 1.0)),
            "frac_all_correct": float(np.mean(np.all(raw == 1.0, axis=1))),
            "frac_all_wrong": float(np.mean(np.all(raw < 1.0, axis=1))),
            "generation_rounds": float(len(rounds)),
            "groups_kept": float(kept),
            "groups_dropped": float(n_groups - kept if self.cfg.dynamic_sampling else 0),  # fill included
            "groups_short": float(shortfall),
            "completion_len_mean": float(np.mean(lengths)),
            "completion_len_max": float(np.max(lengths)),
            "truncation_rate": float(np.mean(np.concatenate([x["out"].truncated for x in rounds]))),
        }

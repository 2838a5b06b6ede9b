"""The experiment config: one `ml_collections.ConfigDict` shared by `configs/*.py`, and `build()`, which
turns it into the typed, validated pieces before any work starts.

`configs/<algorithm>.py:get_config(arg)` calls `base_config(algorithm, size=arg)`; `arg` picks the size:
`tiny` (tests), `default` (learns in minutes on 2 CPU cores) or `qwen3_30b_a3b` (the TPU shape).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from gspo_jax import losses
from gspo_jax import model as model_lib
from gspo_jax.advantages import PRESET_ADVANTAGE_SCALE
from gspo_jax.rollout import RolloutConfig
from gspo_jax.tasks import make_task

SIZES = ("tiny", "default", "qwen3_30b_a3b")
OLD_LOGP_SOURCES = ("sampler", "trainer")
REPLAY = ("none", "R2", "R3")  # R2: π_old's routing recomputed by the trainer; R3: the sampler's

_DEFAULT_MODEL = dict(
    vocab_size=128,
    embed_dim=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mlp_dim=256,
    num_experts=8,
    top_k=2,
    moe_mlp_dim=128,
    dense_layers=(0,),
    lb_loss_coef=0.01,
    z_loss_coef=0.001,
)


def _dataclass_dict(dc) -> dict[str, Any]:
    return {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc)}


def base_config(algorithm: str, size: str = "default") -> ml_collections.ConfigDict:
    """The full config for `algorithm` (a `losses.PRESETS` name) at `size`."""
    if algorithm not in losses.PRESETS:
        raise ValueError(f"algorithm={algorithm!r} is not allowed; choose one of {tuple(losses.PRESETS)}")
    if size not in SIZES:
        raise ValueError(f"config arg (size) {size!r} is not allowed; choose one of {SIZES}")
    c = ml_collections.ConfigDict()
    c.algorithm = algorithm
    c.seed = 0

    if size == "qwen3_30b_a3b":
        c.model = _dataclass_dict(model_lib.get_config("qwen3_30b_a3b"))
    elif size == "tiny":
        c.model = _dataclass_dict(model_lib.get_config("tiny"))
    else:
        c.model = _dataclass_dict(model_lib.ModelConfig(**_DEFAULT_MODEL))
    c.model.dense_layers = tuple(c.model.dense_layers)

    c.loss = _dataclass_dict(losses.PRESETS[algorithm])

    # Sums of three one-digit numbers: the warm start solves ~17% of held-out prompts, which leaves
    # RL both headroom and informative groups (see the README's results).
    c.task = ml_collections.ConfigDict(dict(name="arithmetic", digits=1, operands=3, ops="+"))
    c.prompt_len = 24  # the prompt bucket (BOS + prompt), tokens
    c.max_new_tokens = 12

    c.rollout = _dataclass_dict(
        RolloutConfig(num_groups=8, group_size=8, advantage_scale=PRESET_ADVANTAGE_SCALE[algorithm])
    )
    if algorithm == "dapo":
        c.rollout.update(
            dynamic_sampling=True, max_rounds=3, overlong_filter=False, overlong_cache_len=4, overlong_factor=1.0
        )

    c.train = ml_collections.ConfigDict(
        dict(
            num_iterations=150,
            epochs=1,
            minibatches=2,
            microbatches=1,
            learning_rate=1e-4,
            warmup_steps=5,
            end_lr_factor=0.1,
            weight_decay=0.0,
            max_grad_norm=1.0,
            b1=0.9,
            b2=0.99,
            old_logp_source="trainer",
            routing_replay="none",
            drift_metrics=True,
            eval_every=10,
            eval_batches=4,
            checkpoint_every=10,
            keep_checkpoints=3,
        )
    )
    c.warm_start = ml_collections.ConfigDict(dict(steps=160, batch_size=64, learning_rate=3e-3, cache_dir=""))
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, expert=1, tensor=1))
    c.tokenizer_path = ""  # a local tokenizer directory (e.g. a real model's); "" = the built-in one
    c.hf_checkpoint = ""  # a local Hugging Face checkpoint directory to start from; "" = random init

    if size == "tiny":
        c.prompt_len, c.max_new_tokens = 24, 8
        c.rollout.update(num_groups=2, group_size=4)
        c.train.update(num_iterations=3, minibatches=2, eval_every=2, eval_batches=1, checkpoint_every=1)
        c.warm_start.update(steps=4, batch_size=8)
    if size == "qwen3_30b_a3b":
        c.task = ml_collections.ConfigDict(dict(name="gsm8k"))
        c.prompt_len, c.max_new_tokens = 512, 1024
        c.rollout.update(num_groups=64, group_size=8)
        c.train.update(num_iterations=500, minibatches=4, learning_rate=1e-6, warmup_steps=10)
        c.warm_start.update(steps=0)
        c.mesh.update(data=1, fsdp=-1, expert=8, tensor=1)  # -1: whatever devices remain
    if c.loss.aggregation == "seq_mean_token_sum_norm":
        c.loss.sum_norm_len = float(c.max_new_tokens)  # Dr.GRPO: the max completion length
    return c


@dataclasses.dataclass(frozen=True)
class Built:
    """The typed pieces of a config, all validated."""

    model: model_lib.ModelConfig
    loss: losses.LossConfig
    rollout: RolloutConfig
    task: Any


def _typed(name: str, cls, values: dict):
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"config.{name}: unknown field(s) {unknown}; allowed: {sorted(fields)}")
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"config.{name}: {e}") from None
    except TypeError as e:
        raise ValueError(f"config.{name}: {e}") from None


def _check(cond: bool, field: str, allowed: str, value) -> None:
    if not cond:
        raise ValueError(f"config.{field}={value!r} is not allowed; {allowed}")


def build(c: ml_collections.ConfigDict) -> Built:
    """Validates the whole config and returns its typed pieces; raises ValueError naming the key."""
    m = dict(c.model)
    m["dense_layers"] = tuple(m.get("dense_layers", ()))
    model_cfg = _typed("model", model_lib.ModelConfig, m)
    if c.hf_checkpoint:
        # The checkpoint fixes the architecture; config.model still picks what HF does not describe.
        from gspo_jax import hf

        keep = ("dispatch", "param_dtype", "dtype", "lb_loss_coef", "z_loss_coef")
        try:
            model_cfg = hf.config_from_hf(c.hf_checkpoint, **{k: getattr(model_cfg, k) for k in keep})
        except (OSError, ValueError) as e:
            raise ValueError(f"config.hf_checkpoint={c.hf_checkpoint!r}: {e}") from None
    loss_cfg = _typed("loss", losses.LossConfig, dict(c.loss))
    rollout_cfg = _typed("rollout", RolloutConfig, dict(c.rollout))
    task_kwargs = {k: v for k, v in c.task.items() if k != "name"}
    try:
        task = make_task(c.task.name, **task_kwargs)
    except ValueError as e:
        raise ValueError(f"config.task: {e}") from None
    t, w = c.train, c.warm_start
    for key in ("prompt_len", "max_new_tokens"):
        _check(isinstance(c[key], int) and c[key] >= 1, key, "it must be an int >= 1", c[key])
    for key in (
        "num_iterations",
        "epochs",
        "minibatches",
        "microbatches",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
    ):
        _check(isinstance(t[key], int) and t[key] >= 1, f"train.{key}", "it must be an int >= 1", t[key])
    for key in ("learning_rate", "max_grad_norm"):
        _check(t[key] > 0, f"train.{key}", "it must be > 0", t[key])
    _check(
        t.old_logp_source in OLD_LOGP_SOURCES,
        "train.old_logp_source",
        f"choose one of {OLD_LOGP_SOURCES}",
        t.old_logp_source,
    )
    _check(t.routing_replay in REPLAY, "train.routing_replay", f"choose one of {REPLAY}", t.routing_replay)
    batch = rollout_cfg.num_groups * rollout_cfg.group_size
    _check(
        batch % (t.minibatches * t.microbatches) == 0,
        "train.minibatches",
        f"num_groups×group_size={batch} must be divisible by minibatches×microbatches",
        t.minibatches,
    )
    _check(isinstance(w.steps, int) and w.steps >= 0, "warm_start.steps", "it must be an int >= 0", w.steps)
    _check(
        model_cfg.vocab_size >= 128 or c.tokenizer_path,
        "model.vocab_size",
        "the built-in tokenizer needs vocab_size >= 128",
        model_cfg.vocab_size,
    )
    if loss_cfg.aggregation == "seq_mean_token_sum_norm":
        _check(
            loss_cfg.sum_norm_len == float(c.max_new_tokens),
            "loss.sum_norm_len",
            f"Dr.GRPO normalises by the max completion length, max_new_tokens={c.max_new_tokens}",
            loss_cfg.sum_norm_len,
        )
    return Built(model=model_cfg, loss=loss_cfg, rollout=rollout_cfg, task=task)

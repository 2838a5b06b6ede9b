"""The experiment config's layout: one `ml_collections.ConfigDict` for `configs/<algorithm>.py`, every
key at its default (`base_config`), and what the command line needs of it (`missing_key`). Its typed,
validated build, and every setting derived from it, is `gspo_jax/built.py`.

`base_config(algorithm, size)` lays out every key: the model, task and lengths of a size, the rollout,
train and warm-start settings, the mesh; then the algorithm (`gspo_jax/algorithms.py`) fills in its
loss, advantage scaling and rollout tricks. Sizes (`model_config.SIZES`, the model of each): `tiny`
(tests), `default` (learns in minutes on 2 CPU cores) or `qwen3_30b_a3b` (the TPU shape).

Tasks (`task_config`): `config.task.name` picks the task, and `config.task` holds one section per
registered task (`tasks.TASKS`), each exactly that task's dataclass fields, at their defaults unless
the size sets them. Only the named task's section is read, so one flag switches task with its
settings at hand: `--config.task.name=countdown --config.task.countdown.count=4`, or your own data with
`--config.task.name=gsm8k --config.task.gsm8k.path=train.parquet --config.task.gsm8k.eval_path=test.jsonl`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import ml_collections

from gspo_jax import algorithms
from gspo_jax.critic import CriticConfig
from gspo_jax.lora import LoraConfig
from gspo_jax.model_config import SIZES, config_fields
from gspo_jax.optimizer import OptimizerConfig
from gspo_jax.rollout import RolloutConfig
from gspo_jax.tasks import TASKS, check_fields, task_fields
from gspo_jax.validation import check_choice


def _dataclass_dict(dc) -> dict[str, Any]:
    return {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc)}


def task_config(name: str, **values) -> ml_collections.ConfigDict:
    """`config.task`: `name`, the task to run, and one section per registered task holding exactly its
    dataclass fields with their defaults; `values` set fields of task `name`'s section."""
    check_fields(name, values)
    sections = {n: {**task_fields(n), **(values if n == name else {})} for n in TASKS}
    return ml_collections.ConfigDict(dict(name=name, **sections))


def task_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The task a config runs: its name and its section's values (what its results depend on)."""
    return dict(name=config.task.name, **config.task.get(config.task.name, {}))


def missing_key(config: ml_collections.ConfigDict, key: str) -> str | None:
    """Why `config.<key>` (dotted) is not a key of `config`, in one line naming what its section holds (a
    task section: that task's fields); None when it is a key."""
    node, path = config, ["config"]
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict):
            return f"no such config key: {key}; {'.'.join(path)} is a value, not a section"
        if part not in node:
            if path[1:2] == ["task"] and len(path) == 3 and path[2] in TASKS:
                return f"no such config key: {key}; task {path[2]!r} has the fields: {', '.join(task_fields(path[2]))}"
            hint = ""
            if path[1:] == ["task"] and any(part in task_fields(n) for n in TASKS):
                hint = f" (a task's fields live in its section, e.g. config.task.{node.get('name')}.{part})"
            return f"no such config key: {key}; {'.'.join(path)} has: {', '.join(sorted(node.keys()))}{hint}"
        node, path = node[part], [*path, part]
    return None


def optimizer_keys(**values) -> dict[str, Any]:
    """Every `OptimizerConfig` key (AdamW, warmup then cosine decay), its defaults where not given;
    `freeze_router` only where given (the policy's RL update, `config.train`, has it)."""
    opt = OptimizerConfig(**values)
    keep = lambda name: name != "freeze_router" or name in values
    return {f.name: getattr(opt, f.name) for f in dataclasses.fields(opt) if f.compare and keep(f.name)}


def base_config(algorithm: str, size: str = "default") -> ml_collections.ConfigDict:
    """The full config of `algorithm` (an `algorithms.ALGORITHMS` name) at `size`."""
    alg = algorithms.get(algorithm)
    check_choice("config", "size", size, tuple(SIZES))
    config = ml_collections.ConfigDict()
    config.algorithm = alg.name
    config.seed = 0
    # On CPU, compile the step programs for compile time (gspo_jax.compiles.FAST_CPU_COMPILE): a run's
    # first iteration seconds sooner, each step as fast for small models; False for large ones on CPU.
    config.cpu_fast_compile = True

    config.model = config_fields(SIZES[size])
    # LoRA (`gspo_jax/lora.py`): rank 0 trains the full model; rank > 0 freezes the base and trains
    # adapters on `targets` (of "attention", "mlp", "experts", "router").
    config.lora = _dataclass_dict(LoraConfig())

    # Sums of three one-digit numbers: the default size's warm start solves 35-50% of held-out prompts
    # (seed 0: 34.7%, seed 1: 49.7%), which leaves RL both headroom and informative groups.
    config.task = task_config("arithmetic", digits=1, operands=3, ops="+")
    config.prompt_len = 24  # the prompt bucket (BOS + prompt), tokens
    config.max_new_tokens = 12

    config.rollout = _dataclass_dict(RolloutConfig(num_groups=8, group_size=8))
    config.train = ml_collections.ConfigDict(
        dict(
            num_iterations=150,
            epochs=1,
            minibatches=2,
            microbatches=1,
            # More micro-batches where one would hold over this many tokens per data-parallel device
            # (`built.resolve_microbatches`): the update's activations stay bounded however large the rollout.
            microbatch_tokens=4096,
            # freeze_router: the MoE routers' weights out of the RL update (NeMo-RL's RL setting)
            **optimizer_keys(learning_rate=1e-4, warmup_steps=5, max_grad_norm=1.0, b2=0.99, freeze_router=False),
            old_logp_source="trainer",
            routing_replay="none",
            drift_metrics=True,
            drift_subsample=1,  # measure drift on every n-th sequence of the batch (1: all)
            routing_diagnostics=True,  # flipped-vs-unflipped loss split, router margin / entropy / load
            eval_every=10,
            eval_batches=4,
            checkpoint_every=10,
            keep_checkpoints=3,
        )
    )
    config.warm_start = ml_collections.ConfigDict(
        dict(
            steps=160,
            batch_size=64,
            **optimizer_keys(learning_rate=3e-3, warmup_steps=16, weight_decay=1e-4),  # optax's AdamW, no clipping
            cache_dir="",  # "" = the workdir
        )
    )
    config.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, expert=1, tensor=1))
    # Sampling on devices of its own (`overlap.py`): the last `rollout_devices` devices become the sampler's
    # mesh, with axes `mesh.rollout` (-1: what its other axes leave); the axes above then cover the rest,
    # the trainer's. 0: one mesh for both. Needs rollout.staleness >= 1, so that the two can overlap.
    config.mesh.rollout_devices = 0
    config.mesh.rollout = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1))
    # Trackers beside JSONL and TensorBoard (`gspo_jax/trackers.py`; "" turns one off), and what a sweep's
    # run is (its group and arm, set by the sweep runner). Never part of what trains: a run resumes with
    # them changed.
    config.logging = ml_collections.ConfigDict(
        dict(
            group="",
            arm="",
            tags="",  # comma-separated
            wandb=ml_collections.ConfigDict(dict(project="", entity="", name="", mode="online")),
            mlflow=ml_collections.ConfigDict(dict(tracking_uri="", experiment="gspo_jax", run_name="")),
        )
    )
    config.tokenizer_path = ""  # a local tokenizer directory (e.g. a real model's); "" = the built-in one
    config.hf_checkpoint = ""  # a local Hugging Face checkpoint directory to start from; "" = random init

    _resize(config, size)
    _set_algorithm(config, alg)  # last: the loss reads the size's max_new_tokens
    return config


def _resize(config: ml_collections.ConfigDict, size: str) -> None:
    """What `size` changes from the base laid out by `base_config` (the lengths, batch, schedule and,
    for the TPU shape, the task, model memory settings and mesh)."""
    if size == "default":
        # Drift (two forwards of the batch) on every 4th sequence keeps the instruments well under 15% of
        # an iteration (docs/BENCHMARKS.md); training is unaffected.
        config.train.drift_subsample = 4
        # 32 prompts × 8 per iteration at lr 3e-4, 200 iterations: held-out accuracy dips for the first
        # ~40 iterations, then climbs (seed 0: 35% -> 80% by iteration 200 for GRPO, 71% by 230 for GSPO;
        # 8 prompts at lr 1e-4, the earlier default, gained ~7 points in 150). configs/sweeps/main_job.py
        # checks it over algorithms and seeds. lr 1e-3 first lost half the warm start's accuracy.
        config.rollout.num_groups = 32
        config.train.update(num_iterations=200, learning_rate=3e-4, eval_every=20)
    if size == "tiny":
        config.prompt_len, config.max_new_tokens = 24, 8
        config.rollout.update(num_groups=2, group_size=4)
        config.train.update(num_iterations=3, minibatches=2, eval_every=2, eval_batches=1, checkpoint_every=1)
        config.warm_start.update(steps=4, batch_size=8, warmup_steps=1)
    if size == "qwen3_30b_a3b":
        config.task = task_config("gsm8k")  # the shipped GSM8K-format fixture; point task.gsm8k.path at yours
        config.prompt_len, config.max_new_tokens = 512, 1024
        config.rollout.update(num_groups=64, group_size=8)
        config.train.update(num_iterations=500, minibatches=4, learning_rate=1e-6, warmup_steps=10)
        # What makes it fit a v5p-64 slice (docs/BENCHMARKS.md, "Scale"): layers rematerialised, the LM head and
        # log-softmax over 512 positions at a time, scoring and prefill in 4 chunks of the batch; with
        # the batch split over all 32 chips (expert parallelism) the minibatch needs no micro-batches.
        config.model.update(remat="full", logprob_chunk=512, batch_chunks=4)
        config.train.update(microbatches=1, microbatch_tokens=0)
        config.warm_start.update(steps=0)
        config.mesh.update(data=1, fsdp=-1, expert=8, tensor=1)  # -1: whatever devices remain


def _set_algorithm(config: ml_collections.ConfigDict, alg: algorithms.Algorithm) -> None:
    """`alg`'s loss, advantage scaling and rollout tricks, from its one home; a critic section where it
    has a critic."""
    # A key whose default is None (dual_clip_c, geo_mask_delta, ...) is a float placeholder: settable from the CLI.
    loss = _dataclass_dict(alg.loss_config(config.max_new_tokens))
    config.loss = {k: ml_collections.config_dict.placeholder(float) if v is None else v for k, v in loss.items()}
    config.rollout.update(advantage_scale=alg.advantage_scale, **alg.rollout)
    if alg.critic:
        critic = {k: v for k, v in _dataclass_dict(CriticConfig()).items() if k != "model"}
        # model: the trunk's architecture with trunk="separate" (e.g. --config.critic.model.num_layers=2);
        # with trunk="policy" the critic copies the policy's trunk and this section is not read.
        config.critic = ml_collections.ConfigDict(
            dict(
                **critic,
                model=config.model.to_dict(),
                **optimizer_keys(learning_rate=3e-4, warmup_steps=5, max_grad_norm=1.0, b2=0.99),
            )
        )


def as_json(config: ml_collections.ConfigDict) -> str:
    """The config as a workdir records it (`config.json`)."""
    return config.to_json_best_effort(indent=2)


def warm_start_key(config: ml_collections.ConfigDict) -> str:
    """A hash of what the warm start depends on: model, task, its own settings, seed, lengths and how its
    step is compiled (`cpu_fast_compile`: XLA:CPU's two code generators round differently)."""
    ws = {k: v for k, v in config.warm_start.items() if k != "cache_dir"}
    blob = json.dumps(
        dict(
            model=config.model.to_dict(),
            task=task_settings(config),
            ws=ws,
            seed=config.seed,
            P=config.prompt_len,
            N=config.max_new_tokens,
            fast_compile=config.cpu_fast_compile,
        ),
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]

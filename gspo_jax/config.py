"""The experiment config: one `ml_collections.ConfigDict` for `configs/<algorithm>.py`, and `build()`,
which turns it into the typed, validated pieces before any work starts.

`base_config(algorithm, size)` lays out every key: the model, task and lengths of a size, the rollout,
train and warm-start settings, the mesh; then the algorithm (`gspo_jax/algorithms.py`) fills in its
loss, advantage scaling and rollout tricks. Sizes (`model_config.SIZES`, the model of each): `tiny`
(tests), `default` (learns in minutes on 2 CPU cores) or `qwen3_30b_a3b` (the TPU shape).

Tasks (`task_config`): `config.task.name` picks the task, and `config.task` holds one section per
registered task (`tasks.TASKS`), each exactly that task's dataclass fields, at their defaults unless
the size sets them. Only the named task's section is read, so one flag switches task with its
settings at hand: `--config.task.name=countdown --config.task.countdown.count=4`, or your own data with
`--config.task.name=gsm8k --config.task.gsm8k.path=train.parquet --config.task.gsm8k.eval_path=test.jsonl`.

`build` refuses at the door (a one-line `ConfigError`, exit 2 from scripts/train.py, nothing written)
whatever cannot work: a bad value or unknown field, a path that does not exist, a task whose train or
eval split would be empty, a prompt bucket (`prompt_len`) shorter than the task's longest prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import jax
import ml_collections

from gspo_jax import algorithms, hf, losses
from gspo_jax.critic import CriticConfig
from gspo_jax.model_config import SIZES, ModelConfig
from gspo_jax.optimizer import OptimizerConfig
from gspo_jax.rollout import RolloutConfig
from gspo_jax.tasks import TASKS, check_fields, check_splits, load_tokenizer, make_task, task_fields
from gspo_jax.validation import ConfigError, check, check_choice, check_int, is_int

OLD_LOGP_SOURCES = ("sampler", "trainer")
# R2: π_old's routing recomputed by the trainer; R3: the sampler's expert ids; R3W: the sampler's ids and
# their combine weights (weight replay).
REPLAY = ("none", "R2", "R3", "R3W")
SAMPLER_ROUTING = ("R3", "R3W")  # the replays of the sampler's routing


def _dataclass_dict(dc) -> dict[str, Any]:
    return {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc)}


def task_config(name: str, **values) -> ml_collections.ConfigDict:
    """`config.task`: `name`, the task to run, and one section per registered task holding exactly its
    dataclass fields with their defaults; `values` set fields of task `name`'s section."""
    check_fields(name, values)
    sections = {n: {**task_fields(n), **(values if n == name else {})} for n in TASKS}
    return ml_collections.ConfigDict(dict(name=name, **sections))


def task_settings(c: ml_collections.ConfigDict) -> dict[str, Any]:
    """The task a config runs: its name and its section's values (what its results depend on)."""
    return dict(name=c.task.name, **c.task.get(c.task.name, {}))


def missing_key(c: ml_collections.ConfigDict, key: str) -> str | None:
    """Why `config.<key>` (dotted) is not a key of `c`, in one line naming what its section holds (a
    task section: that task's fields); None when it is a key."""
    node, path = c, ["config"]
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


def _optimizer_keys(**values) -> dict[str, Any]:
    """Every `OptimizerConfig` key (AdamW, warmup then cosine decay), its defaults where not given;
    `freeze_router` only where given (the policy's RL update, `config.train`, has it)."""
    opt = OptimizerConfig(**values)
    keep = lambda name: name != "freeze_router" or name in values
    return {f.name: getattr(opt, f.name) for f in dataclasses.fields(opt) if f.compare and keep(f.name)}


def base_config(algorithm: str, size: str = "default") -> ml_collections.ConfigDict:
    """The full config of `algorithm` (an `algorithms.ALGORITHMS` name) at `size`."""
    alg = algorithms.get(algorithm)
    check_choice("config", "size", size, tuple(SIZES))
    c = ml_collections.ConfigDict()
    c.algorithm = alg.name
    c.seed = 0
    # On CPU, compile the step programs for compile time (gspo_jax.compiles.FAST_CPU_COMPILE): a run's
    # first iteration seconds sooner, each step as fast for small models; False for large ones on CPU.
    c.cpu_fast_compile = True

    c.model = _dataclass_dict(SIZES[size])
    c.model.dense_layers = tuple(c.model.dense_layers)

    # Sums of three one-digit numbers: the default size's warm start solves 35-50% of held-out prompts
    # (seed 0: 34.7%, seed 1: 49.7%), which leaves RL both headroom and informative groups.
    c.task = task_config("arithmetic", digits=1, operands=3, ops="+")
    c.prompt_len = 24  # the prompt bucket (BOS + prompt), tokens
    c.max_new_tokens = 12

    c.rollout = _dataclass_dict(RolloutConfig(num_groups=8, group_size=8))
    c.train = ml_collections.ConfigDict(
        dict(
            num_iterations=150,
            epochs=1,
            minibatches=2,
            microbatches=1,
            # More micro-batches where one would hold over this many tokens per data-parallel device
            # (`update_microbatches`): the update's activations stay bounded however large the rollout.
            microbatch_tokens=4096,
            # freeze_router: the MoE routers' weights out of the RL update (NeMo-RL's RL setting)
            **_optimizer_keys(learning_rate=1e-4, warmup_steps=5, max_grad_norm=1.0, b2=0.99, freeze_router=False),
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
    c.warm_start = ml_collections.ConfigDict(
        dict(
            steps=160,
            batch_size=64,
            **_optimizer_keys(learning_rate=3e-3, warmup_steps=16, weight_decay=1e-4),  # optax's AdamW, no clipping
            cache_dir="",  # "" = the workdir
        )
    )
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, expert=1, tensor=1))
    c.tokenizer_path = ""  # a local tokenizer directory (e.g. a real model's); "" = the built-in one
    c.hf_checkpoint = ""  # a local Hugging Face checkpoint directory to start from; "" = random init

    _resize(c, size)
    _set_algorithm(c, alg)  # last: the loss reads the size's max_new_tokens
    return c


def _resize(c: ml_collections.ConfigDict, size: str) -> None:
    """What `size` changes from the base laid out by `base_config` (the lengths, batch, schedule and,
    for the TPU shape, the task, model memory settings and mesh)."""
    if size == "default":
        # Drift (two forwards of the batch) on every 4th sequence keeps the instruments well under 15% of
        # an iteration (docs/BENCHMARKS.md); training is unaffected.
        c.train.drift_subsample = 4
        # 32 prompts × 8 per iteration at lr 3e-4, 200 iterations: held-out accuracy dips for the first
        # ~40 iterations, then climbs (seed 0: 35% -> 80% by iteration 200 for GRPO, 71% by 230 for GSPO;
        # 8 prompts at lr 1e-4, the earlier default, gained ~7 points in 150). configs/sweeps/main_job.py
        # checks it over algorithms and seeds. lr 1e-3 first lost half the warm start's accuracy.
        c.rollout.num_groups = 32
        c.train.update(num_iterations=200, learning_rate=3e-4, eval_every=20)
    if size == "tiny":
        c.prompt_len, c.max_new_tokens = 24, 8
        c.rollout.update(num_groups=2, group_size=4)
        c.train.update(num_iterations=3, minibatches=2, eval_every=2, eval_batches=1, checkpoint_every=1)
        c.warm_start.update(steps=4, batch_size=8, warmup_steps=1)
    if size == "qwen3_30b_a3b":
        c.task = task_config("gsm8k")  # the shipped GSM8K-format fixture; point task.gsm8k.path at yours
        c.prompt_len, c.max_new_tokens = 512, 1024
        c.rollout.update(num_groups=64, group_size=8)
        c.train.update(num_iterations=500, minibatches=4, learning_rate=1e-6, warmup_steps=10)
        # What makes it fit a v5p-64 slice (docs/BENCHMARKS.md, "Scale"): layers rematerialised, the LM head and
        # log-softmax over 512 positions at a time, scoring and prefill in 4 chunks of the batch; with
        # the batch split over all 32 chips (expert parallelism) the minibatch needs no micro-batches.
        c.model.update(remat="full", logprob_chunk=512, batch_chunks=4)
        c.train.update(microbatches=1, microbatch_tokens=0)
        c.warm_start.update(steps=0)
        c.mesh.update(data=1, fsdp=-1, expert=8, tensor=1)  # -1: whatever devices remain


def _set_algorithm(c: ml_collections.ConfigDict, alg: algorithms.Algorithm) -> None:
    """`alg`'s loss, advantage scaling and rollout tricks, from its one home; a critic section where it
    has a critic."""
    # A key whose default is None (dual_clip_c, geo_mask_delta, ...) is a float placeholder: settable from the CLI.
    loss = _dataclass_dict(alg.loss_config(c.max_new_tokens))
    c.loss = {k: ml_collections.config_dict.placeholder(float) if v is None else v for k, v in loss.items()}
    c.rollout.update(advantage_scale=alg.advantage_scale, **alg.rollout)
    if alg.critic:
        critic = {k: v for k, v in _dataclass_dict(CriticConfig()).items() if k != "model"}
        # model: the trunk's architecture with trunk="separate" (e.g. --config.critic.model.num_layers=2);
        # with trunk="policy" the critic copies the policy's trunk and this section is not read.
        c.critic = ml_collections.ConfigDict(
            dict(
                **critic,
                model=c.model.to_dict(),
                **_optimizer_keys(learning_rate=3e-4, warmup_steps=5, max_grad_norm=1.0, b2=0.99),
            )
        )
        c.critic.model.dense_layers = tuple(c.model.dense_layers)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """`config.train` less its optimizer's keys: the RL loop's schedule and update split, where π_old's
    log-probs and routing come from, the routing instruments, evaluation and checkpoints."""

    num_iterations: int
    epochs: int
    minibatches: int
    microbatches: int
    microbatch_tokens: int  # 0: no bound (`update_microbatches`)
    old_logp_source: str  # OLD_LOGP_SOURCES
    routing_replay: str  # REPLAY
    drift_metrics: bool
    drift_subsample: int
    routing_diagnostics: bool
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    keep_checkpoints: int

    def __post_init__(self):
        keys = ("num_iterations", "epochs", "minibatches", "microbatches", "drift_subsample", "eval_every")
        for key in (*keys, "checkpoint_every", "keep_checkpoints"):
            check_int("config", f"train.{key}", getattr(self, key))
        check_int("config", "train.microbatch_tokens", self.microbatch_tokens, low=0)
        check_int("config", "train.eval_batches", self.eval_batches)
        check_choice("config", "train.old_logp_source", self.old_logp_source, OLD_LOGP_SOURCES)
        check_choice("config", "train.routing_replay", self.routing_replay, REPLAY)
        for key in ("drift_metrics", "routing_diagnostics"):
            check(isinstance(getattr(self, key), bool), "config", f"train.{key}", getattr(self, key), "True or False")

    @property
    def updates(self) -> int:
        """Optimizer updates over the whole run (the schedule's length)."""
        return self.num_iterations * self.epochs * self.minibatches


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """`config.warm_start`: supervised steps on demonstrations before RL (0: none), their optimizer."""

    steps: int
    batch_size: int
    cache_dir: str  # "": the workdir
    optimizer: OptimizerConfig

    def __post_init__(self):
        if self.cache_dir:  # created on first use: it, or its parent, must be a directory already
            d = Path(self.cache_dir)
            ok = d.is_dir() or (not d.exists() and d.parent.is_dir())
            allowed = "a directory, or a new one in an existing directory"
            check(ok, "config", "warm_start.cache_dir", self.cache_dir, allowed)
        check_int("config", "warm_start.steps", self.steps, low=0)
        check_int("config", "warm_start.batch_size", self.batch_size)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """`config.mesh`: each axis's size; in the config -1 for the devices left, which `build` resolves
    against the devices (a built config's mesh has every size)."""

    data: int
    fsdp: int
    expert: int
    tensor: int

    def axes(self) -> dict[str, int]:
        """The sizes as `sharding.make_mesh`'s keyword arguments."""
        return dataclasses.asdict(self)

    @property
    def data_size(self) -> int:
        """How many devices a batch is split over: data × fsdp × expert (`sharding.DATA_AXES`)."""
        return self.data * self.fsdp * self.expert


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """The sampler's lengths: the prompt bucket (BOS + prompt) and the completion, in tokens."""

    prompt_len: int
    max_new_tokens: int

    def __post_init__(self):
        for key in ("prompt_len", "max_new_tokens"):
            check_int("config", key, getattr(self, key))

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class Built:
    """The typed pieces of a config, all validated."""

    algorithm: str
    seed: int
    model: ModelConfig
    loss: losses.LossConfig
    rollout: RolloutConfig
    task: Any
    sampler: SamplerConfig
    train: TrainConfig
    optimizer: OptimizerConfig  # the policy's: `config.train`'s optimizer keys
    warm_start: WarmStartConfig
    mesh: MeshConfig
    critic: CriticConfig | None  # PPO's value model, its architecture resolved
    critic_optimizer: OptimizerConfig | None  # `config.critic`'s optimizer keys
    microbatches: int  # per update: train.microbatches, raised by train.microbatch_tokens
    hf_checkpoint: str  # "": a random init from `seed`
    tokenizer_path: str  # "": the built-in tokenizer
    cpu_fast_compile: bool  # XLA:CPU's fast-compile code generation for the step programs
    config_json: str  # the config built from (`as_json`): a workdir's config.json, what a resume must match
    warm_start_key: str  # the warm start's cache name (`warm_start_key`): runs that share it share the cache

    @property
    def batch_size(self) -> int:
        """Sequences per rollout: num_groups × group_size."""
        return self.rollout.num_groups * self.rollout.group_size


def _typed(name: str, cls, values: dict):
    """`cls(**values)` with any error as one line prefixed by the config key (a `ConfigError` that
    names its key already, `config.<name>.…`, as it is)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"config.{name}: unknown field(s) {unknown}; allowed: {sorted(fields)}")
    try:
        return cls(**values)
    except ConfigError as e:
        if str(e).startswith(f"config.{name}."):
            raise
        raise ConfigError(f"config.{name}: {e}") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.{name}: {e}") from None


def build(c: ml_collections.ConfigDict, device_count: int | None = None) -> Built:
    """Validates the whole config and returns its typed pieces; raises `ConfigError` naming the key.
    The mesh is resolved against `device_count` devices (default: this runtime's, `jax.device_count()`,
    which a mesh over several processes must cover whole). What a run needs of the config itself (its
    JSON, its warm start's cache name) is taken here: nothing after the build reads the ConfigDict."""
    model_cfg = _model(c)
    loss_cfg = _typed("loss", losses.LossConfig, dict(c.loss))
    rollout_cfg = _typed("rollout", RolloutConfig, dict(c.rollout))
    task = _task(c.task)
    sampler = SamplerConfig(prompt_len=c.prompt_len, max_new_tokens=c.max_new_tokens)
    t, optimizer = _with_optimizer("train", TrainConfig, dict(c.train))
    no_router = "False: the model has no MoE layer, so no router to freeze"
    check(not optimizer.freeze_router or model_cfg.num_moe_layers > 0, "config", "train.freeze_router", True, no_router)
    check(isinstance(c.cpu_fast_compile, bool), "config", "cpu_fast_compile", c.cpu_fast_compile, "True or False")
    batch = rollout_cfg.num_groups * rollout_cfg.group_size
    _check_update_splits(batch, t)
    w = _with_optimizer("warm_start", WarmStartConfig, dict(c.warm_start), nested=True)
    critic_cfg, critic_opt = _critic(c, model_cfg)
    experts = [("model", model_cfg)] + ([("critic.model", critic_cfg.model)] if critic_cfg else [])
    for key, m in experts[1:]:  # a separate critic scores the batch in its own chunks
        check(batch % m.batch_chunks == 0, "config", f"{key}.batch_chunks", m.batch_chunks, f"a divisor of {batch}")
    chunks = model_cfg.batch_chunks
    check(
        batch % (chunks * t.drift_subsample) == 0,
        "config",
        "model.batch_chunks",
        chunks,
        f"a divisor of num_groups×group_size={batch} (and of the drift batch, batch / train.drift_subsample)",
    )
    mesh = _check_mesh(
        _typed("mesh", MeshConfig, dict(c.mesh)),
        batch=batch,
        score_chunk=batch // chunks,
        critic_chunk=batch // critic_cfg.model.batch_chunks if critic_cfg else 0,  # 0: no critic
        microbatch=batch // (t.minibatches * t.microbatches),
        drift_batch=batch // (t.drift_subsample * chunks),
        warm_start_batch=w.batch_size if w.steps else 0,  # 0: no warm start, nothing to split
        sampler_threads=rollout_cfg.sampler_threads,
        devices=jax.device_count() if device_count is None else device_count,
        processes=jax.process_count() if device_count is None else 1,
        num_experts={key: m.num_experts for key, m in experts if m.num_moe_layers},
    )
    _check_lengths(c, task, model_cfg, loss_cfg)
    micro = update_microbatches(
        batch // t.minibatches, c.prompt_len + c.max_new_tokens, mesh.data_size, t.microbatches, t.microbatch_tokens
    )
    return Built(
        algorithm=c.algorithm,
        seed=c.seed,
        model=model_cfg,
        loss=loss_cfg,
        rollout=rollout_cfg,
        task=task,
        sampler=sampler,
        train=t,
        optimizer=optimizer,
        warm_start=w,
        mesh=mesh,
        critic=critic_cfg,
        critic_optimizer=critic_opt,
        microbatches=micro,
        hf_checkpoint=c.hf_checkpoint,
        tokenizer_path=c.tokenizer_path,
        cpu_fast_compile=c.cpu_fast_compile,
        config_json=as_json(c),
        warm_start_key=warm_start_key(c),
    )


def as_json(c: ml_collections.ConfigDict) -> str:
    """The config as a workdir records it (`config.json`)."""
    return c.to_json_best_effort(indent=2)


def warm_start_key(c: ml_collections.ConfigDict) -> str:
    """A hash of what the warm start depends on: model, task, its own settings, seed, lengths and how its
    step is compiled (`cpu_fast_compile`: XLA:CPU's two code generators round differently)."""
    ws = {k: v for k, v in c.warm_start.items() if k != "cache_dir"}
    blob = json.dumps(
        dict(
            model=c.model.to_dict(),
            task=task_settings(c),
            ws=ws,
            seed=c.seed,
            P=c.prompt_len,
            N=c.max_new_tokens,
            fast_compile=c.cpu_fast_compile,
        ),
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _check_update_splits(batch: int, t: TrainConfig) -> None:
    """The rollout's `batch` sequences against what the update splits it into: minibatches ×
    microbatches, and the drift measurement's subsample."""
    check(
        batch % (t.minibatches * t.microbatches) == 0,
        "config",
        "train.minibatches",
        t.minibatches,
        f"num_groups×group_size={batch} must be divisible by minibatches×microbatches",
    )
    check(
        batch % t.drift_subsample == 0,
        "config",
        "train.drift_subsample",
        t.drift_subsample,
        f"a divisor of num_groups×group_size={batch}",
    )


def _model(c: ml_collections.ConfigDict) -> ModelConfig:
    """`config.model` typed; with `hf_checkpoint`, the checkpoint's architecture and `config.model`'s
    choice of what Hugging Face does not describe. The local paths (`hf_checkpoint`, `tokenizer_path`)
    must exist: nothing is downloaded at run time."""
    m = dict(c.model)
    m["dense_layers"] = tuple(m.get("dense_layers", ()))
    model_cfg = _typed("model", ModelConfig, m)
    for key, what in (
        ("hf_checkpoint", "a local Hugging Face checkpoint directory"),
        ("tokenizer_path", "a local tokenizer.json or directory"),
    ):
        if c[key]:  # nothing is downloaded at run time: a path must exist
            check(Path(c[key]).exists(), "config", key, c[key], f"{what} that exists (nothing is downloaded)")
    if c.hf_checkpoint:
        # The checkpoint fixes the architecture; config.model still picks what HF does not describe.
        keep = ("dispatch", "param_dtype", "dtype", "lb_loss_coef", "z_loss_coef")
        keep += ("scan_layers", "remat", "logprob_chunk", "batch_chunks")  # how the model runs
        try:
            model_cfg = hf.config_from_hf(c.hf_checkpoint, **{k: getattr(model_cfg, k) for k in keep})
        except (OSError, ValueError) as e:
            raise ConfigError(f"config.hf_checkpoint={c.hf_checkpoint!r}: {e}") from None
    return model_cfg


def _check_lengths(
    c: ml_collections.ConfigDict, task: Any, model_cfg: ModelConfig, loss_cfg: losses.LossConfig
) -> None:
    """What the lengths must hold: the prompt bucket the task's longest prompt (tokenized as the run
    will), the vocabulary the built-in tokenizer's, Dr.GRPO's constant the max completion length."""
    tokenizer = load_tokenizer(c.tokenizer_path or None)
    bos = 0 if tokenizer.bos_token_id is None else 1
    longest = bos + task.max_prompt_tokens(lambda text: tokenizer.encode(text, add_special_tokens=False))
    check(
        longest <= c.prompt_len,
        "config",
        "prompt_len",
        c.prompt_len,
        f"the prompt bucket must hold the longest prompt of task {task.name!r}: {longest} tokens (BOS included)",
    )
    check(
        model_cfg.vocab_size >= 128 or bool(c.tokenizer_path),
        "config",
        "model.vocab_size",
        model_cfg.vocab_size,
        "the built-in tokenizer needs vocab_size >= 128",
    )
    if loss_cfg.aggregation == "seq_mean_token_sum_norm":
        check(
            loss_cfg.sum_norm_len == float(c.max_new_tokens),
            "config",
            "loss.sum_norm_len",
            loss_cfg.sum_norm_len,
            f"Dr.GRPO normalises by the max completion length, max_new_tokens={c.max_new_tokens}",
        )


def _with_optimizer(name: str, cls, section: dict, nested: bool = False):
    """`config.<name>` as `cls` and the `OptimizerConfig` of its optimizer keys: (typed, optimizer),
    or with `nested` one `cls` holding it as its `optimizer` field."""
    optimizer = OptimizerConfig.from_config(section, f"config.{name}")
    rest = {k: v for k, v in section.items() if k not in _optimizer_keys(learning_rate=1.0, freeze_router=False)}
    if nested:
        return _typed(name, cls, {**rest, "optimizer": optimizer})
    return _typed(name, cls, rest), optimizer


def _task(section: ml_collections.ConfigDict):
    """The task `config.task` names, built from its section; every section's fields checked, and the
    task's train and eval splits checked non-empty (`tasks.check_splits`)."""
    name = section.get("name")
    check_choice("config", "task.name", name, sorted(TASKS))
    stray = sorted(set(section) - {"name"} - set(TASKS))
    if stray:
        raise ConfigError(
            f"config.task: unknown key(s) {stray}; it holds `name` and one section per task, {sorted(TASKS)}, "
            f"each with that task's fields (e.g. config.task.{name}.{stray[0]})"
        )
    for n in TASKS:  # every section: a misspelt field is refused even where another task runs
        try:
            check_fields(n, section.get(n, {}))
        except ConfigError as e:
            raise ConfigError(f"config.task.{n}: {e}") from None
    try:
        task = make_task(name, **dict(section.get(name, {})))
        check_splits(task)
    except ValueError as e:  # ConfigError included; one line, prefixed with the section
        raise ConfigError(f"config.task.{name}: {str(e).splitlines()[0]}") from None
    return task


def update_microbatches(rows: int, seq_len: int, data: int, at_least: int, max_tokens: int) -> int:
    """How many micro-batches an update of `rows` sequences of `seq_len` tokens runs: the fewest, from
    `at_least` (`train.microbatches`) up, that split the rows evenly over the `data` devices and hold at
    most `max_tokens` tokens per device (0: no bound); the finest such split where none does.

    On CPU the bound is also speed: XLA maps a step's temporaries afresh for every call, and where a
    VM's host takes freed memory back, each call faults them in again (docs/BENCHMARKS.md)."""
    counts = [m for m in range(at_least, rows + 1) if rows % m == 0 and rows // m % data == 0]
    if not counts:  # no count splits the rows over the devices: `build` has refused such a config already
        return at_least
    fits = [m for m in counts if max_tokens == 0 or rows // m // data * seq_len <= max_tokens]
    return fits[0] if fits else counts[-1]


def _critic(c: ml_collections.ConfigDict, policy: ModelConfig) -> tuple[CriticConfig | None, OptimizerConfig | None]:
    """`config.critic` typed, its trunk's architecture resolved (the policy's, or `critic.model`), and
    its optimizer; (None, None) without a critic."""
    has = "critic" in c
    needs = algorithms.get(c.algorithm).critic
    check(
        has == needs,
        "config",
        "critic",
        "present" if has else "absent",
        f"a section exactly when the algorithm has a critic ({c.algorithm}: {needs})",
    )
    if not has:
        return None, None
    section = dict(c.critic)
    opt = OptimizerConfig.from_config(section, "config.critic")
    fields = {f.name for f in dataclasses.fields(CriticConfig)} | {f.name for f in dataclasses.fields(opt) if f.compare}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ConfigError(f"config.critic: unknown field(s) {unknown}; allowed: {sorted(fields)}")
    model = policy
    if section.get("trunk") == "separate":
        m = dict(section["model"])
        m["dense_layers"] = tuple(m.get("dense_layers", ()))
        model = _typed("critic.model", ModelConfig, m)
        check(
            model.vocab_size == policy.vocab_size,
            "config",
            "critic.model.vocab_size",
            model.vocab_size,
            f"the policy's, {policy.vocab_size} (the critic reads the same tokens)",
        )
    keys = {f.name for f in dataclasses.fields(CriticConfig)} - {"model"}
    critic = _typed("critic", CriticConfig, {**{k: section[k] for k in keys if k in section}, "model": model})
    return critic, opt


def _check_mesh(
    mesh: MeshConfig,
    *,
    batch: int,
    score_chunk: int,
    critic_chunk: int = 0,
    microbatch: int,
    drift_batch: int,
    warm_start_batch: int,
    sampler_threads: int = 1,
    devices: int,
    processes: int = 1,
    num_experts: dict[str, int],
) -> MeshConfig:
    """Axis sizes against the devices present (on several processes the mesh must cover them all), and
    the data axes against every batch they split; returns the mesh with -1 resolved."""
    sizes = mesh.axes()
    for k, v in sizes.items():
        check(is_int(v) and (v >= 1 or v == -1), "config", f"mesh.{k}", v, "an int >= 1, or -1 for the devices left")
    check(list(sizes.values()).count(-1) <= 1, "config", "mesh", dict(sizes), "at most one axis may be -1")
    n = devices
    known = math.prod(v for v in sizes.values() if v != -1)
    check(
        known <= n and (-1 not in sizes.values() or n % known == 0),
        "config",
        "mesh",
        dict(sizes),
        f"there are {n} devices",
    )
    sizes = {k: (n // known if v == -1 else v) for k, v in sizes.items()}
    on = math.prod(sizes.values())
    allowed = f"1 on a mesh of {on} devices (threads split the batch on one device)"
    check(sampler_threads <= 1 or on == 1, "config", "rollout.sampler_threads", sampler_threads, allowed)
    data = sizes["data"] * sizes["fsdp"] * sizes["expert"]  # sharding.DATA_AXES
    for what, size in (
        ("num_groups×group_size", batch),
        ("a batch chunk (model.batch_chunks)", score_chunk),
        ("a critic batch chunk (critic.model.batch_chunks)", critic_chunk),
        ("a micro-batch (train.minibatches, train.microbatches)", microbatch),
        ("a drift batch chunk (train.drift_subsample, model.batch_chunks)", drift_batch),
        ("warm_start.batch_size", warm_start_batch),
    ):
        check(size % data == 0, "config", "mesh", dict(sizes), f"data×fsdp×expert={data} must divide {what}={size}")
    for key, n in num_experts.items():  # expert parallelism gives each expert shard E / expert of them
        if sizes["expert"] > 1:
            check(
                n % sizes["expert"] == 0,
                "config",
                "mesh.expert",
                sizes["expert"],
                f"a divisor of {key}.num_experts={n}",
            )
    if processes > 1 and on != devices:
        raise ConfigError(
            f"config.mesh: {mesh.axes()} covers {on} of the {devices} devices of "
            f"{processes} processes; a multi-process mesh must use them all (set one axis to -1)"
        )
    return MeshConfig(**sizes)

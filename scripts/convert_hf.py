"""Converts Hugging Face Qwen3-MoE / Mixtral checkpoints to and from our orbax format and from training runs.

Usage:
    # HF safetensors directory -> JAX directory (orbax nnx.State + model_config.json)
    python scripts/convert_hf.py --in HF_DIR --out JAX_DIR --direction hf2jax [--dtype bfloat16]
    # JAX directory -> HF directory loadable by transformers.AutoModelForCausalLM.from_pretrained
    python scripts/convert_hf.py --in JAX_DIR --out HF_DIR --direction jax2hf [--max-shard-bytes N]
    # a run's checkpoint (default: its newest finished one) -> HF directory, tokenizer included
    python scripts/convert_hf.py --in WORKDIR --out HF_DIR --direction run2hf [--step N] [--model-type mixtral]
    # a LoRA run's adapters -> PEFT directory (`peft.PeftModel.from_pretrained(base, PEFT_DIR)`)
    python scripts/convert_hf.py --in WORKDIR --out PEFT_DIR --direction run2peft [--step N]

run2hf reads the run's workdir only (it may still be training) and writes the policy parameters of the
step, bitwise, with config.json (the run's model; the tokenizer's bos/eos/pad ids) and the run's
tokenizer files (config.tokenizer_path, or the built-in tokenizer). The model type defaults to that of
the run's config.hf_checkpoint, else qwen3_moe (mixtral for a model without q/k norm); a model the type
cannot express, a missing step or a non-empty --out (without --overwrite) is refused before anything
is written.

run2peft writes the adapters of a LoRA run's step in PEFT's format (`gspo_jax/hf_lora.py`), with the
run's config.hf_checkpoint as `base_model_name_or_path`: the base itself is not written.

JAX_DIR holds `state/` (an `orbax.checkpoint.StandardCheckpointer` save of the model's
`nnx.State`, restorable against `gspo_jax.model.abstract_model(cfg)[1]`), `model_config.json`
(our `ModelConfig`, the HF model_type and the token ids / max length of the source
config.json) and the tokenizer files, passed through in both directions. Parameters are
copied bitwise unless --dtype casts them. Everything is held in host memory on one
process: fine for small and mid-sized models, not a sharded multi-host converter.
"""

import argparse
import dataclasses
import json
import os
from pathlib import Path

# This project never uses PyTorch: keep transformers' notice about its absence off stderr, so that a
# refused export prints exactly one line.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from gspo_jax import hf, hf_config, hf_lora, snapshots  # noqa: E402
from gspo_jax import model as model_lib  # noqa: E402
from gspo_jax.model_config import DTYPES, ModelConfig  # noqa: E402
from gspo_jax.tasks.tokenizer import TOKENIZER_DIR, load_tokenizer  # noqa: E402
from gspo_jax.validation import ConfigError  # noqa: E402

STATE_DIR = "state"
MODEL_CONFIG = "model_config.json"
# Fields of the source config.json kept for the way back (they do not describe the architecture).
HF_EXTRA_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def hf_to_jax(src: str, dst: str, *, dtype: str | None = None, overwrite: bool = False) -> ModelConfig:
    """HF directory -> JAX directory; returns the model config."""
    cfg, _, state = hf.load_hf_checkpoint(src, dtype=dtype)
    source = json.loads(Path(src, "config.json").read_text())
    os.makedirs(dst, exist_ok=True)
    meta = {
        "model_config": dataclasses.asdict(cfg),
        "hf_model_type": source["model_type"],
        "hf_extra": {k: source[k] for k in HF_EXTRA_FIELDS if k in source},
    }
    Path(dst, MODEL_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(dst, STATE_DIR)), state, force=overwrite)
    checkpointer.wait_until_finished()
    hf.copy_passthrough_files(src, dst)
    return cfg


def jax_to_hf(src: str, dst: str, *, model_type: str | None = None, max_shard_bytes: int) -> ModelConfig:
    """JAX directory (as written by `hf_to_jax`) -> HF directory; returns the model config."""
    meta = json.loads(Path(src, MODEL_CONFIG).read_text())
    cfg = ModelConfig(**meta["model_config"])
    _, abstract = model_lib.abstract_model(cfg)
    state = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(src, STATE_DIR)), abstract)
    hf.save_hf_checkpoint(
        dst,
        cfg,
        state,
        model_type or meta["hf_model_type"],
        max_shard_bytes=max_shard_bytes,
        tokenizer_dir=src,
        extra_config=meta.get("hf_extra"),
    )
    return cfg


def _default_model_type(run: snapshots.Run) -> str:
    """The model_type of the HF checkpoint the run started from, else qwen3_moe (mixtral without q/k norm)."""
    source = Path(run.config.get("hf_checkpoint") or "", "config.json")
    if run.config.get("hf_checkpoint") and source.is_file():
        model_type = json.loads(source.read_text()).get("model_type")
        if model_type in hf_config.MODEL_TYPES:
            return model_type
    return "qwen3_moe" if run.model.qk_norm else "mixtral"


def _host_sharding() -> jax.sharding.Sharding:
    """The host's CPU device where JAX has one, so an export needs no accelerator memory."""
    try:
        return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    except RuntimeError:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _check_out(dst: Path, workdir: Path, overwrite: bool) -> None:
    """Refuses an --out that is a file, inside the run's workdir, or non-empty without `overwrite`."""
    if dst.exists() and not dst.is_dir():
        raise ConfigError(f"--out {str(dst)!r} is a file; it must be a directory (new or empty)")
    if dst.resolve().is_relative_to(workdir.resolve()):
        raise ConfigError(f"--out {str(dst)!r} is inside the run's workdir {str(workdir)!r}, which is never written")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ConfigError(f"--out {str(dst)!r} is not empty; pass --overwrite to replace the checkpoint in it")


def run_to_hf(
    workdir: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    step: int | None = None,
    model_type: str | None = None,
    max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> tuple[ModelConfig, int]:
    """A run's checkpoint at `step` (default: its newest finished one) -> HF directory with the run's
    tokenizer; returns (model config, step). Everything is checked before the first write, and the
    workdir is only read. Raises ConfigError for what cannot be exported."""
    workdir, dst = Path(workdir), Path(dst)
    run = snapshots.open_run(workdir)
    step = _finished_step(workdir, step)
    model_type = model_type or _default_model_type(run)
    tokenizer_path = run.config.get("tokenizer_path") or ""
    tokenizer = load_tokenizer(tokenizer_path or None)
    extra = {}
    if run.config.get("hf_checkpoint"):  # kept from the source: token ids, max_position_embeddings
        source = json.loads(Path(run.config.hf_checkpoint, "config.json").read_text())
        extra.update({k: source[k] for k in HF_EXTRA_FIELDS if k in source})
    for name in ("bos", "eos", "pad"):  # the ids the run generated with win
        token_id = getattr(tokenizer, f"{name}_token_id")
        if token_id is not None:
            extra[f"{name}_token_id"] = int(token_id)
    try:
        hf_config.exportable_config(run.model, model_type, extra=extra)
    except ValueError as e:
        raise ConfigError(f"{workdir} cannot be exported as {model_type}: {e}") from None
    _check_out(dst, workdir, overwrite)

    params = snapshots.load_params(run, step, _host_sharding())
    tokenizer_dir = Path(tokenizer_path) if tokenizer_path else TOKENIZER_DIR
    is_dir = tokenizer_dir.is_dir()
    dst.mkdir(parents=True, exist_ok=True)
    for name in hf.PASSTHROUGH_FILES:  # --overwrite: an earlier export's tokenizer files must not mix with ours
        (dst / name).unlink(missing_ok=True)
    hf.save_hf_checkpoint(
        dst,
        run.model,
        params,
        model_type,
        max_shard_bytes=max_shard_bytes,
        tokenizer_dir=tokenizer_dir if is_dir else None,
        extra_config=extra,
    )
    if not is_dir or not (dst / "tokenizer_config.json").exists():  # a bare tokenizer.json: transformers' files
        tokenizer.save_pretrained(dst)
    return run.model, step


def run_to_peft(
    workdir: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    step: int | None = None,
    model_type: str | None = None,
    overwrite: bool = False,
) -> tuple[ModelConfig, int]:
    """A LoRA run's adapters at `step` (default: the newest finished one) -> PEFT directory; returns (the
    run's model config, step). Checked before the first write; the workdir is only read."""
    workdir, dst = Path(workdir), Path(dst)
    run = snapshots.open_run(workdir, adapters=True)
    step = _finished_step(workdir, step)
    model_type = model_type or _default_model_type(run)
    try:
        hf_config.exportable_config(run.model, model_type)
    except ValueError as e:
        raise ConfigError(f"{workdir} cannot be exported as {model_type}: {e}") from None
    _check_out(dst, workdir, overwrite)
    adapters = snapshots.load_params(run, step, _host_sharding())
    hf_lora.save_peft_adapter(dst, run.model, adapters, model_type, base_model_name_or_path=run.config.hf_checkpoint)
    return run.model, step


def _finished_step(workdir: Path, step: int | None) -> int:
    """`step`, or the newest finished checkpoint when None; ConfigError if it is not a finished one."""
    available = snapshots.steps(workdir)
    if not available:
        raise ConfigError(f"{workdir} has no finished checkpoint yet")
    if step is not None and step not in available:
        raise ConfigError(f"--step {step} is not a finished checkpoint of {workdir}; steps: {available}")
    return available[-1] if step is None else step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--in", dest="src", required=True, help="source directory (run2hf, run2peft: the run's workdir)"
    )
    parser.add_argument("--out", dest="dst", required=True, help="destination directory")
    parser.add_argument("--direction", required=True, choices=("hf2jax", "jax2hf", "run2hf", "run2peft"))
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="hf2jax: cast parameters (default: keep)")
    parser.add_argument(
        "--model-type",
        choices=hf_config.MODEL_TYPES,
        help="jax2hf: default: the source's; "
        "run2hf, run2peft: default: the run's config.hf_checkpoint's, else qwen3_moe (mixtral if no q/k norm)",
    )
    parser.add_argument("--max-shard-bytes", type=int, default=hf.DEFAULT_MAX_SHARD_BYTES, help="jax2hf, run2hf")
    parser.add_argument(
        "--step", type=int, help="run2hf, run2peft: the checkpoint step (default: the newest finished one)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="hf2jax: replace an existing state/; run2hf, run2peft: write into a full --out",
    )
    args = parser.parse_args(argv)
    if args.step is not None and args.direction not in ("run2hf", "run2peft"):
        parser.error("--step is for --direction run2hf or run2peft")
    where = ""
    if args.direction == "hf2jax":
        cfg = hf_to_jax(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
    elif args.direction == "jax2hf":
        cfg = jax_to_hf(args.src, args.dst, model_type=args.model_type, max_shard_bytes=args.max_shard_bytes)
    else:
        export, kwargs = (
            (run_to_hf, dict(max_shard_bytes=args.max_shard_bytes)) if args.direction == "run2hf" else (run_to_peft, {})
        )
        try:
            cfg, step = export(
                args.src, args.dst, step=args.step, model_type=args.model_type, overwrite=args.overwrite, **kwargs
            )
        except ConfigError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        where = f" step {step}"
        if args.direction == "run2peft":
            adapters = sum(x.size for x in jax.tree.leaves(snapshots.open_run(args.src, adapters=True).abstract_params))
            print(f"run2peft: {args.src}{where} -> {args.dst} ({adapters:,} adapter parameters, rank {cfg.lora.rank})")
            return
    total, active = model_lib.count_params(cfg)
    print(f"{args.direction}: {args.src}{where} -> {args.dst} ({total:,} parameters, {active:,} active per token)")


if __name__ == "__main__":
    main()

"""Converts Hugging Face Qwen3-MoE / Mixtral checkpoints to and from our orbax format.

Usage:
    # HF safetensors directory -> JAX directory (orbax nnx.State + model_config.json)
    python scripts/convert_hf.py --in HF_DIR --out JAX_DIR --direction hf2jax [--dtype bfloat16]
    # JAX directory -> HF directory loadable by transformers.AutoModelForCausalLM.from_pretrained
    python scripts/convert_hf.py --in JAX_DIR --out HF_DIR --direction jax2hf [--max-shard-bytes N]

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

import orbax.checkpoint as ocp

from gspo_jax import hf
from gspo_jax import model as model_lib

STATE_DIR = "state"
MODEL_CONFIG = "model_config.json"
# Fields of the source config.json kept for the way back (they do not describe the architecture).
HF_EXTRA_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def hf_to_jax(src: str, dst: str, *, dtype: str | None = None, overwrite: bool = False) -> model_lib.ModelConfig:
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


def jax_to_hf(src: str, dst: str, *, model_type: str | None = None, max_shard_bytes: int) -> model_lib.ModelConfig:
    """JAX directory (as written by `hf_to_jax`) -> HF directory; returns the model config."""
    meta = json.loads(Path(src, MODEL_CONFIG).read_text())
    cfg = model_lib.ModelConfig(**meta["model_config"])
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in", dest="src", required=True, help="source directory")
    parser.add_argument("--out", dest="dst", required=True, help="destination directory")
    parser.add_argument("--direction", required=True, choices=("hf2jax", "jax2hf"))
    parser.add_argument("--dtype", choices=tuple(model_lib.DTYPES), help="hf2jax: cast parameters (default: keep)")
    parser.add_argument("--model-type", choices=hf.MODEL_TYPES, help="jax2hf: default: the source's")
    parser.add_argument("--max-shard-bytes", type=int, default=hf.DEFAULT_MAX_SHARD_BYTES, help="jax2hf")
    parser.add_argument("--overwrite", action="store_true", help="hf2jax: replace an existing state/")
    args = parser.parse_args(argv)
    if args.direction == "hf2jax":
        cfg = hf_to_jax(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
    else:
        cfg = jax_to_hf(args.src, args.dst, model_type=args.model_type, max_shard_bytes=args.max_shard_bytes)
    total, active = model_lib.count_params(cfg)
    print(f"{args.direction}: {args.src} -> {args.dst} ({total:,} parameters, {active:,} active per token)")


if __name__ == "__main__":
    main()

"""Evaluate a policy with the metrics reasoning-RL papers report: greedy accuracy, avg@n, pass@k for k <= n
(the unbiased estimator), maj@k, mean completion length and truncation rate, on n samples of each prompt
of a task's split, with a fixed seed.

Usage:
  python scripts/evaluate.py --workdir /tmp/run --samples 8                 # the run's latest checkpoint
  python scripts/evaluate.py --workdir /tmp/run --step 100 --task countdown --split eval --temperature 0.6
  python scripts/evaluate.py --hf_checkpoint tests/fixtures/qwen3_moe_tiny --task arithmetic --samples 4
  python scripts/evaluate.py --hf_checkpoint DIR --task gsm8k --prompt_len 256 --max_new_tokens 512

The policy comes from a run's checkpoint (its config gives the model, the task, the lengths and the
temperature unless the flags say otherwise) or from a local Hugging Face checkpoint (its config gives the
model; the default size gives the rest). Prints the numbers and writes them as JSON (--out; default
WORKDIR/eval/<step>-<task>-<split>-n<samples>.json, or eval-<checkpoint>-<task>-<split>-n<samples>.json
here). Exit codes: 0 done; 2 refused, one line on stderr (no checkpoint, a bad flag, an unknown task).
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # this project never uses PyTorch

import ml_collections  # noqa: E402

from gspo_jax import config as config_lib  # noqa: E402
from gspo_jax import context, snapshots  # noqa: E402
from gspo_jax import programs as programs_lib  # noqa: E402
from gspo_jax import sharding as sharding_lib  # noqa: E402
from gspo_jax.evaluate import sample_n  # noqa: E402
from gspo_jax.exit_codes import EXIT_REFUSED  # noqa: E402
from gspo_jax.tasks import prompt_iterator  # noqa: E402
from gspo_jax.validation import ConfigError  # noqa: E402

SPLITS = ("eval", "train")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a run's workdir: evaluate its latest (or --step) checkpoint")
    source.add_argument("--hf_checkpoint", help="a local Hugging Face checkpoint directory")
    parser.add_argument("--step", type=int, help="the run's checkpoint to evaluate (default: its latest)")
    parser.add_argument("--task", help="the task's name (default: the run's, or the default config's)")
    parser.add_argument("--split", default="eval", choices=SPLITS, help="the task's split (default %(default)s)")
    parser.add_argument("--samples", type=int, default=8, help="n samples per prompt (default %(default)s)")
    parser.add_argument("--num_prompts", type=int, default=256, help="prompts evaluated (default %(default)s)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the run's rollout's)")
    parser.add_argument("--top_k", type=int, default=0, help="0: off (default)")
    parser.add_argument("--top_p", type=float, default=1.0, help="1: off (default)")
    parser.add_argument("--seed", type=int, default=0, help="picks the prompts and every draw (default 0)")
    parser.add_argument("--batch_prompts", type=int, default=16, help="prompts per sampler call (default 16)")
    parser.add_argument("--prompt_len", type=int, help="prompt bucket in tokens (default: the run's, or the size's)")
    parser.add_argument("--max_new_tokens", type=int, help="completion budget (default: the run's, or the size's)")
    parser.add_argument("--out", help="the JSON file to write")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.out and Path(args.out).is_dir():
        parser.error(f"--out={args.out}: is a directory; name the JSON file")
    for name, low in (("samples", 1), ("num_prompts", 1), ("batch_prompts", 1), ("top_k", 0)):
        if getattr(args, name) < low:
            parser.error(f"--{name}={getattr(args, name)}: must be >= {low}")
    for name in ("prompt_len", "max_new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: must be >= 1")
    if args.temperature is not None and not args.temperature > 0:
        parser.error(f"--temperature={args.temperature}: must be > 0 (greedy accuracy is reported beside the samples)")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top_p={args.top_p}: must be in (0, 1]")
    if args.hf_checkpoint and args.step is not None:
        parser.error("--step goes with --workdir")
    return args


def _config(args) -> tuple[ml_collections.ConfigDict, str, int | None]:
    """The config the policy is evaluated under, a name for its source, and the run's step (or None)."""
    if args.workdir:
        run = snapshots.open_run(args.workdir)
        done = snapshots.steps(run.workdir)
        if not done:
            raise ConfigError(f"{run.workdir} has no finished checkpoint to evaluate")
        step = done[-1] if args.step is None else args.step
        if step not in done:
            raise ConfigError(f"--step={step} is not a finished checkpoint of {run.workdir} (steps: {done})")
        return ml_collections.ConfigDict(run.config.to_dict()), str(run.workdir), step
    path = Path(args.hf_checkpoint)
    if not path.is_dir():
        raise ConfigError(f"--hf_checkpoint={args.hf_checkpoint!r} is not a directory")
    c = config_lib.base_config("grpo", "default")
    c.hf_checkpoint = str(path)
    c.tokenizer_path = str(path) if (path / "tokenizer.json").exists() else ""
    return c, path.name, None


def evaluate(args) -> dict:
    c, source, step = _config(args)
    if args.task:
        if args.task not in c.task:
            raise ConfigError(f"--task={args.task!r} is not one of {sorted(k for k in c.task if k != 'name')}")
        c.task.name = args.task
    temperature = float(c.rollout.temperature if args.temperature is None else args.temperature)
    c.rollout.update(num_groups=args.batch_prompts, group_size=args.samples, sampler_threads=0, staleness=0)
    for name in ("prompt_len", "max_new_tokens"):  # the build checks them against the task and the model
        if getattr(args, name) is not None:
            c[name] = getattr(args, name)
    c.warm_start.steps = 0
    built = snapshots.build_here(c)
    prompts = prompt_iterator(built.task, seed=args.seed, split=args.split)
    if hasattr(prompts, "__len__") and args.num_prompts > len(prompts):
        raise ConfigError(f"--num_prompts={args.num_prompts}: the {args.split} split has {len(prompts)} prompts")
    mesh = sharding_lib.make_mesh()
    if step is None:
        graphdef, params = programs_lib.init_policy(built, mesh)
    else:
        run = snapshots.open_run(args.workdir)
        graphdef, params = run.graphdef, snapshots.load_params(run, step)
    rollout = context.make_rollout(built, graphdef, params, mesh)
    numbers = sample_n(
        rollout,
        params,
        split=args.split,
        num_prompts=args.num_prompts,
        temperature=temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        progress=not args.no_progress,
    )
    setting = dict(source=source, step=step, task=built.task.name, split=args.split, num_prompts=args.num_prompts)
    setting.update(samples=args.samples, temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    setting["max_new_tokens"] = built.sampler.max_new_tokens
    return {**setting, **numbers}


def default_out(args, report: dict) -> Path:
    name = f"{report['task']}-{report['split']}-n{report['samples']}.json"
    if args.workdir:
        return Path(args.workdir) / "eval" / f"{report['step']}-{name}"
    return Path(f"eval-{Path(args.hf_checkpoint).name}-{name}")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        report = evaluate(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    out = Path(args.out) if args.out else default_out(args, report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    width = max(len(k) for k in report)
    print(
        "\n".join(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}" for k, v in report.items())
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

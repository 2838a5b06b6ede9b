"""The race (issue 40): one RL iteration of the `iteration` shape in gspo_jax against TRL's
GRPOTrainer on the same device, in one process, the same random model for both.

    python -m benchmarks.trl_race                  # needs torch and trl beside the project (not its deps)

The shape (`benchmarks.run.shapes.iteration_config("iteration")`): a random MoE of width 256, 4
layers of 4 experts top-2, float32, 16 prompts × 8 completions of up to 64 tokens of the default
task, one optimizer step per iteration, GSPO (sequence-level ratios, no KL), drift on. gspo_jax's
model is exported with `hf.save_hf_checkpoint` (Qwen3-MoE) and loaded by `transformers`, so TRL
trains the very same weights with the project's tokenizer and task reward; its generation is
`transformers`' `generate` (TRL's default, no vLLM). Each side's figure is the mean of its compiled or
warmed-up iterations 2..5 (TRL: the wall time of `training_step` around each step, synchronised).
Writes benchmarks/race-<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")  # leave torch the rest of the GPU

import jax  # noqa: E402

from benchmarks.run.iterations import RACE_ITERATIONS, race_iteration  # noqa: E402
from benchmarks.run.shapes import iteration_config  # noqa: E402
from gspo_jax import hf, provenance  # noqa: E402
from gspo_jax import programs as programs_lib  # noqa: E402
from gspo_jax.built import build  # noqa: E402
from gspo_jax.sharding import mesh_from_config  # noqa: E402
from gspo_jax.tasks import load_tokenizer, prompt_iterator  # noqa: E402
from gspo_jax.tasks.tokenizer import write_tokenizer_files  # noqa: E402

STEPS = RACE_ITERATIONS  # per side; 2..5 are timed (0 and 1 compile or warm up)


def trl_side(c, built, model_dir: str) -> dict:
    """TRL's GRPOTrainer on the same model, task, batch and completion length: seconds per step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = load_tokenizer(built.tokenizer_path or None)
    prompts = prompt_iterator(built.task, seed=0, split="train")
    G = c.rollout.group_size
    examples = [next(prompts) for _ in range(c.rollout.num_groups * STEPS)]
    bos = tokenizer.bos_token or ""
    data = Dataset.from_dict(dict(prompt=[bos + e.prompt for e in examples], index=list(range(len(examples)))))

    def reward(prompts, completions, index, **_):
        return [float(built.task.reward(text, examples[i])) for text, i in zip(completions, index)]

    wanted = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=c.rollout.num_groups * G,
        num_generations=G,
        max_completion_length=c.max_new_tokens,
        temperature=1.0,
        learning_rate=float(c.train.learning_rate),
        beta=0.0,
        importance_sampling_level="sequence",  # GSPO
        num_iterations=1,
        steps_per_generation=1,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        fp16=False,
        seed=0,
        shuffle_dataset=False,
        dataloader_num_workers=0,
    )
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    dropped = sorted(set(wanted) - known)
    args = GRPOConfig(**{k: v for k, v in wanted.items() if k in known})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            times.append(time.perf_counter() - self.t0)

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[Timer()]
    )
    trainer.train()
    import trl

    return dict(
        seconds=float(statistics.mean(times[2:6])),
        step_seconds=times,
        trl=trl.__version__,
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        config_fields_not_in_this_trl=dropped,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default: benchmarks/race-<device>.json")
    args = ap.parse_args()
    c = iteration_config("iteration")
    built = build(c)
    _, params = programs_lib.init_policy(built, mesh_from_config(**built.mesh.axes()))  # the run's own initial weights
    mine = race_iteration(c)
    print(f"gspo_jax: {mine['seconds'] * 1e3:.0f} ms per iteration, split {mine['split']}", flush=True)
    with tempfile.TemporaryDirectory() as model_dir:
        tok_dir = Path(model_dir) / "tokenizer"
        write_tokenizer_files(tok_dir)
        hf.save_hf_checkpoint(model_dir, built.model, params, tokenizer_dir=tok_dir)
        theirs = trl_side(c, built, model_dir)
    ratio = theirs["seconds"] / mine["seconds"]
    print(f"TRL {theirs['trl']}: {theirs['seconds'] * 1e3:.0f} ms per iteration; gspo_jax is {ratio:.2f}x faster")
    device = jax.devices()[0].device_kind
    out = dict(device=device, jax=jax.__version__, gspo_jax=mine, trl=theirs, speedup=ratio)
    path = Path(args.out or Path(__file__).parent / f"race-{provenance.device_slug()}.json")
    path.write_text(json.dumps(out, indent=2, default=float))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

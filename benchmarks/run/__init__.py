"""The benchmark runner (`python -m benchmarks.run`), one module per section or shared part. How close
gspo_jax is to this machine's limit: every figure a ratio measured in this one process.

    python -m benchmarks.run                      # everything; writes benchmarks/results.json
    python -m benchmarks.run --only iteration     # one section (repeatable)
    python -m benchmarks.run --size tiny --out /tmp/r.json   # seconds: the CI smoke test
    python -m benchmarks.run --only real --only loop --real-layers 4   # on a GPU: the 4-layer proxy

Sections:
  peak       best float32 matmul FLOP/s over several square shapes (the denominator of every MFU)
  train      train-step MFU: analytic useful FLOPs / measured time / peak, on the default config
             and on `bench` (width 512, 8 layers, 16 experts top-2); the best call of those in 3 s
             (at least --repeats), and the median's
  loss       forward + backward of `policy_loss` alone, as a share of the train step, per objective
  moe        MoE dispatch paths (dense, ragged, sparse) against each other, forward + backward; and
             again with two (fake CPU) devices beside the expert-parallel all-to-all path
  sampler    generated tokens/s, against the naive decoder, decode MFU, and against batch size
  iteration  one RL iteration of the `iteration` shape, split (rollout, log-probs, updates, drift,
             evaluation, checkpoint + logging), with drift on every sequence, every 4th, or off; the
             compiles after warm-up and the time to the first finished iteration, cold and with the
             persistent compilation cache filled by a previous run
  scaling    one RL iteration of the default config split into everything a run spends time on
             (rollout, log-probs, updates, drift, host work, evaluation, checkpoint, logging), with
             group size and completion length varied one at a time
  diagnostics  the default config's iteration with drift and routing diagnostics on, drift only, and
             both off: the share of an iteration the research instruments cost
  critic     PPO's extra cost on the default config: the train step with and without the critic's
             update, the critic's values pass against the scoring forward, parameter, optimizer and
             compiled-step memory, and whole iterations of PPO against GRPO and GSPO
  real       (accelerators; compile-only on a CPU with --only real) Qwen3-30B-A3B's layer dims at
             --real-layers layers (2 by default): the train step's TFLOP/s and MFU against the measured
             bf16 peak and the device's spec peak, the decode step against its memory floor
  loop       the RL iteration against its own parts in one process: the rollout's time per decode
             step against the sampler's as the rollout calls it and the bare decode step, the
             update's time per token against the isolated train step's, drift's share, and the first
             iteration with the compilation cache filled against a warm one (real dims at
             --real-layers on an accelerator, the tiny shape with --size tiny)
  race       (accelerators) one iteration of the race shape (`benchmarks/trl_race.py` runs TRL's)
  overlap    (--only overlap; two or more devices, or two fake CPU devices in a child process) the
             `iteration` shape at staleness 1 on one mesh over every device, then split in halves
             (`mesh.rollout_devices`): the iteration against the rollout and the trainer's work

On a GPU or TPU the default is real, loop and race, written to benchmarks/results-<device>.json
(-<N>layers at another --real-layers) with the device, versions, command and commit. It ends with a
table of the targets whose sections ran: each figure, its target, and whether this
run met it (docs/BENCHMARKS.md's table adds the ranges over several runs and what limits each miss).

Useful FLOPs are analytic (`gspo_jax/flops.py`), never XLA's cost analysis (it counts a loop body
once): a train step is 6 × (active matmul parameters) × tokens plus attention, 12 × layers × B × T² ×
H × W; decoding a token is 2 × active matmul parameters per sequence (attention over the cache left
out: small at these lengths).
"""

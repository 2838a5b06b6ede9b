"""gspo_jax: critic-free RL (GRPO, DAPO, GSPO, ...) for sparse-MoE language models in JAX.

Shape letters. Array names end in the letters of their axes (`x_BTD`, `logp_BT`, `topk_BLTK`); one
legend for the whole package:

  B  batch: sequences (completions)            M  prompts (groups) per batch, B = M·G
  G  samples per prompt (group size)           T  positions of a sequence; in RL batches T = P + C
  P  prompt positions (the prompt bucket)      C  completion positions (max new tokens)
  S  key/value slots attended to (KV cache)    N  tokens of a flattened batch, B·T
  A  expert assignments, N·K                   Z  sampling candidates (the sampler's max_top_k)
  D  model width                               F  feed-forward width (dense MLP, or one expert)
  V  vocabulary                                H  query heads
  J  key/value heads                           Q  query heads per key/value head, H / J
  W  head width                                E  experts
  K  experts chosen per token (router top-k)   L  MoE layers (the layers whose routing is recorded)
  R  a low-rank adapter's rank (LoRA, `gspo_jax/lora.py`; the sparse dispatch path's block rows too)

Router choices are batch-first everywhere: `[B, L, T, K]`.
"""

__version__ = "0.1.0"

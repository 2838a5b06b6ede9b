r"""Compile a config's RL programs for a TPU slice, with no TPU attached, and say whether they fit.

    python scripts/aot_compile.py --config configs/gspo.py:qwen3_30b_a3b --topology v5p:2x4x4
    python scripts/aot_compile.py --config configs/gspo.py:tiny --topology v5p:2x2x1 \
        --config.mesh.fsdp=2 --config.mesh.expert=2 --programs train_step
    python scripts/aot_compile.py --config configs/gspo.py:tiny --topology v5p:2x2x1 \
        --mesh data=4 --mesh fsdp=2,expert=2 --mesh data=2,tensor=2

Prints, per chip, the argument, output and temporary memory of the train step (one minibatch), the
scoring forward (the whole rollout batch) and the sampler (prefill and decode loop), against the
chip's HBM; the compile time; and the analytic FLOPs of one call with the time they imply at 40% of
the slice's peak; with `--mesh` (repeatable), for each mesh layout in turn, in one table. Needs libtpu
(pip install -e '.[tpu]'). Exit code 2 on a bad flag or config, 1 when a program does not fit.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the TPU topology; run nothing locally
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from gspo_jax import aot  # noqa: E402
from gspo_jax import built as built_lib  # noqa: E402
from gspo_jax.exit_codes import EXIT_REFUSED  # noqa: E402
from gspo_jax.validation import ConfigError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/<algorithm>.py[:size] file.", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x4x4", f"<chip>:<shape>, chip one of {tuple(aot.CHIPS)}.")
_PROGRAMS = flags.DEFINE_list("programs", list(aot.PROGRAMS), f"Which of {aot.PROGRAMS} to compile.")
_MESH = flags.DEFINE_multi_string(
    "mesh",
    [],
    "A mesh layout to compile for instead of config.mesh, e.g. 'data=2,fsdp=2' (axes not named: 1); repeatable.",
)
_JSON = flags.DEFINE_string("json", "", "Also write the rows (bytes per chip, seconds, FLOPs) to this file.")
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv
    rows = []
    try:
        configs = [aot.with_mesh(_CONFIG.value, m) for m in _MESH.value] or [_CONFIG.value]
        for i, config in enumerate(configs):
            layout_rows = aot.compile_report(config, _TOPOLOGY.value, tuple(_PROGRAMS.value))
            # The update's micro-batches as resolved for this slice (`Plan.update_microbatches`).
            devices = len(aot.topology_devices(_TOPOLOGY.value))
            micro = built_lib.build(config, device_count=devices).plan.update_microbatches
            table = aot.format_report(layout_rows, _TOPOLOGY.value, micro, config.model.remat).splitlines()
            print("\n".join(table if i == 0 else table[2:]), flush=True)  # one header for every layout
            rows += layout_rows
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    if _JSON.value:
        with open(_JSON.value, "w", encoding="utf-8") as f:
            json.dump([dict(vars(r), total_bytes=r.total_bytes, fits=r.fits) for r in rows], f, indent=1)
    return 0 if all(r.fits for r in rows) else 1


if __name__ == "__main__":
    app.run(main)

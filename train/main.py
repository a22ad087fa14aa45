"""Train a drafter: `python -m train.main --config=configs/<recipe>.py --workdir=DIR [--config.x.y=...]`.

    python -m train.main --config=configs/smollm2.py --workdir=runs/hspec \\
        --config.drafter.kind=hspec --config.train.num_steps=2000 --config.data.sources=sharegpt

Any recipe field can be overridden with `--config.<section>.<field>=value`; an unknown field is an error.
The target comes from `config.target.path` (HF dir, .gguf, Orbax dir, `smollm2`, or `tiny`: the random
tiny target with a character tokenizer). Running again with the same `--workdir` resumes exactly from the
latest checkpoint (parameters, optimiser state, step, rng and the data iterator's position).
`--config.train.init_from=DRAFTER` (a drafter directory or shipped name such as `smollm2-hspec`) fine-tunes
that drafter: the run starts from its weights and keeps its draft vocabulary, with a fresh optimiser.

The work directory holds:
    checkpoints/      Orbax CheckpointManager: train state + data iterator state, the last N kept
    vocab.npz         the draft vocabulary (top tokens of the supervised training tokens), fixed at the start
    data.json         the data recipe: sources, conversations, excluded evaluation prompts, tokens
    metrics.jsonl     one line per logged step (loss terms, per-slot accuracy, lr, grad norm, tokens/s, tau)
    events.*          TensorBoard event files with the same scalars
    drafter/          the latest drafter, loadable by `eval.generate --drafter DIR/drafter` (rewritten at every
                      checkpoint and at the end)

Many processes: start the same command in every process with `--coordinator=HOST:PORT --num-processes=N
--process-id=I` (or on a cluster that `jax.distributed.initialize()` detects by itself); every process
reads its own slice of each global batch, and process 0 writes the logs and the exported drafter.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "recipe file, e.g. configs/smollm2.py", lock_config=True)
flags.DEFINE_string("workdir", None, "directory for checkpoints, logs and the exported drafter")
flags.DEFINE_string("coordinator", None, "multi-process: address HOST:PORT of process 0's coordinator")
flags.DEFINE_integer("num_processes", None, "multi-process: number of processes")
flags.DEFINE_integer("process_id", None, "multi-process: index of this process")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv) -> int:
    del argv
    import jax
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO

    if FLAGS.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
    from train.loop import train

    try:
        result = train(FLAGS.config, FLAGS.workdir)
    except (ValueError, FileNotFoundError) as err:
        print(f"train.main: error: {err}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    app.run(lambda argv: sys.exit(main(argv)))

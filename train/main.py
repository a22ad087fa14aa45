"""Train a drafter: `python -m train.main --config=configs/<recipe>.py --workdir=DIR [--config.x.y=...]`.

    python -m train.main --config=configs/smollm2.py --workdir=runs/hspec \\
        --config.drafter.kind=hspec --config.train.num_steps=2000 --config.data.sources=sharegpt

Any recipe field can be overridden with `--config.<section>.<field>=value`; an unknown field is an error.
The target comes from `config.target.path` (HF dir, .gguf, Orbax dir, `smollm2`, or `tiny`: the random
tiny target with a character tokenizer). Running again with the same `--workdir` resumes exactly from the
latest checkpoint (parameters, optimiser state, step, rng and the data iterator's position).
`--config.train.init_from=DRAFTER` (a drafter directory or shipped name such as `smollm2-hspec`) fine-tunes
that drafter: the run starts from its weights and keeps its draft vocabulary, with a fresh optimiser.
With `--config.train.init_layers=0,3,4,...` the recipe's drafter may be a smaller one cut from it: those of its
sub-layers, and its most frequent draft tokens where the recipe's draft vocabulary is smaller (train/warm_start.py).

The work directory holds:
    recipe.json       the recipe the directory was created with: a resumed run must match it (target, drafter,
                      data, batch size, optimiser), else an error names the fields that differ
    checkpoints/      Orbax CheckpointManager: train state + data iterator state, the last N kept
    vocab.npz         the draft vocabulary (top tokens of a sample of the supervised training tokens), fixed at
                      the start
    damaged/          checkpoints found damaged on resume, moved here (with a warning) and never deleted
    data.json         the data recipe: sources, conversations, excluded evaluation and held-out prompts, tokens
    metrics.jsonl     one line per logged step (loss terms, per-slot accuracy, lr, grad norm, tokens/s; at
                      evaluation steps the held-out `heldout_*` metrics and the real tau)
    events.*          TensorBoard event files with the same scalars
    drafter/          the latest drafter, loadable by `eval.generate --drafter DIR/drafter` (rewritten at every
                      checkpoint and at the end)

Many processes: start the same command in every process with `--coordinator=HOST:PORT --num_processes=N
--process_id=I` (one process per host; `jax.distributed.initialize` is called with exactly these); every process
reads its own slice of each global batch, and process 0 writes the logs and the exported drafter.

Bad input is one line on stderr, before any data is read or weights loaded: `error: ...` naming the flag,
the recipe field (`--config.train.batch_size`), the data file and line, or the checkpoint step; exit 2 for a
malformed flag, 1 for bad input. Ctrl-C or SIGTERM (in any one process of a job of many) saves the step under
way, says where it stopped and which checkpoint a rerun resumes from, and exits 130; a second Ctrl-C stops at
once.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from hspec_jax import cli

PROG = "python -m train.main"
FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "recipe file, e.g. configs/smollm2.py", lock_config=True)
flags.DEFINE_string("workdir", None, "directory for checkpoints, logs and the exported drafter")
flags.DEFINE_string("coordinator", None, "multi-process: address HOST:PORT of process 0's coordinator")
flags.DEFINE_integer("num_processes", None, "multi-process: number of processes")
flags.DEFINE_integer("process_id", None, "multi-process: index of this process")
flags.DEFINE_string(
    "compile_cache",
    cli.DEFAULT_COMPILE_CACHE,
    "persistent XLA compilation cache directory ('' for none; one process only): a rerun or resume loads the "
    "set-up's and the step's compiled programs instead of compiling them again",
)
flags.mark_flags_as_required(["config", "workdir"])
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def unknown_field(argv: list[str]) -> str | None:
    """The first `--config.` override of `argv` that names no field of the recipe, with the fields it could
    have meant; None if every override names a field (or the recipe does not load)."""
    from hspec_jax.recipes import load_config

    recipe = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    try:
        config = load_config(recipe) if recipe else None
    except (OSError, ValueError):
        return None
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg[2:].split("=", 1)[0].split(".")[1:]
        node = config
        for depth, key in enumerate(path):
            if not hasattr(node, "keys") or key not in node:
                section = ".".join(path[:depth]) or "the recipe"
                known = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "none"
                return f"--config.{'.'.join(path)}: {section} has no field {key!r} (its fields: {known})"
            node = node[key]
    return None


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing with one line for a malformed flag, an unknown or ill-typed `--config.` override, or a
    recipe file that does not load (exit 2). `--help` prints the flags and exits 0, as the argparse tools do (absl
    exits 1)."""
    try:
        rest = FLAGS(argv)
        FLAGS.config.keys()  # a recipe file that failed to load raises here
    except SystemExit as e:
        asked = any(a.split("=")[0] in HELP_FLAGS for a in argv[1:])
        sys.exit(0 if asked and e.code == 1 else e.code)
    except (flags.Error, OSError, SyntaxError, AttributeError, KeyError, TypeError, ValueError) as e:
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
        message = f"--config: {lines[-1]}" if isinstance(e, OSError) else lines[0]
        if isinstance(e, (AttributeError, KeyError)):
            message = unknown_field(argv) or message
        sys.stderr.write(cli.usage_error(PROG, message))
        sys.exit(2)
    if len(rest) > 1:
        sys.stderr.write(cli.usage_error(PROG, f"unexpected argument {rest[1]!r}"))
        sys.exit(2)
    return rest


def main(argv) -> int:
    del argv
    import jax
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every file it writes at INFO
    progress = logging.getLogger("train")  # set-up says what it is doing, one plain line per stage
    progress.setLevel(logging.INFO)
    progress.addHandler(logging.StreamHandler(sys.stderr))
    progress.propagate = False

    if FLAGS.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
    else:  # not across processes: jax 0.10 on CPU loads collectives that disagree between them
        cli.use_compile_cache(FLAGS.compile_cache)
    from train.loop import train

    result = train(FLAGS.config, FLAGS.workdir)
    if jax.process_index() == 0:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    app.run(lambda argv: sys.exit(cli.run(main, argv)), flags_parser=parse_flags)

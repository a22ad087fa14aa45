"""Convert a target checkpoint to Orbax (default) or to a Hugging Face directory, and drafters in and out of
the speculators format (what vLLM serves).

python -m hspec_jax.checkpoints.convert --from smollm2 --to runs/smollm2-orbax
python -m hspec_jax.checkpoints.convert --from model.gguf --to runs/smollm2-hf --format hf --dtype bfloat16
python -m hspec_jax.checkpoints.convert --from runs/x/drafter --to runs/x.spec --format speculators --target smollm2
python -m hspec_jax.checkpoints.convert --from runs/x.spec --to runs/x-drafter --format drafter --target smollm2
python -m hspec_jax.checkpoints.convert --from runs/x/drafter --to runs/x-bf16 --format drafter --target smollm2 \
    --dtype bfloat16

The last re-saves a drafter checkpoint (a training run's export) as the shipped drafters are stored: its weights in
bfloat16 and its lm_head left out where it equals the target's rows in that dtype (loaded from the target), with
its `training.json` copied beside them.

Every argument is checked before any weights are read: the source exists and its config is readable, the
destination is absent or empty, writable, and has room for the weights. The output directory appears only
when complete; a disk that fills up while writing is reported as "no space left on <dir>".
"""

from __future__ import annotations

import os
import shutil
import sys

import jax

from hspec_jax.checkpoints.drafter_io import (
    MANIFEST,
    TRAINING_RECORD,
    read_drafter_config,
    resolve_drafter,
    restore_drafter,
    save_drafter,
    target_lm_head,
)
from hspec_jax.checkpoints.hf import CheckpointError, check_output_directory, export_hf_target
from hspec_jax.checkpoints.orbax_io import save_target
from hspec_jax.checkpoints.sources import load_target, load_tokenizer, read_target_config
from hspec_jax.checkpoints.speculators import (
    export_speculators,
    import_speculators,
    read_speculators_config,
    speculators_drafter_config,
)
from hspec_jax.cli import ArgumentParser, float_dtype, run
from hspec_jax.drafters.api import drafter_param_shapes
from hspec_jax.drafters.config import WINDOW_MODES, check_target
from hspec_jax.models import param_shapes

FORMATS = ("orbax", "hf", "speculators", "drafter")


def parse_args(argv: list[str] | None = None):
    parser = ArgumentParser(prog="python -m hspec_jax.checkpoints.convert", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        help="smollm2, an HF directory, a .gguf file or an Orbax target; with --format speculators a drafter "
        "checkpoint directory; with --format drafter a speculators checkpoint (directory or its config/safetensors) "
        "or a drafter checkpoint to re-save (e.g. in --dtype bfloat16)",
    )
    parser.add_argument("--to", required=True, help="output directory (must not exist or be empty)")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="orbax",
        help="output format: orbax / hf (targets), speculators (export a drafter), drafter (import a speculators one "
        "or re-save a drafter checkpoint)",
    )
    parser.add_argument(
        "--dtype", type=float_dtype, default=None, help="store weights in this dtype (e.g. bfloat16); default: keep"
    )
    parser.add_argument(
        "--target",
        default=None,
        help="the drafter's target (verifier): required to import; on export it supplies embed_tokens",
    )
    parser.add_argument(
        "--verifier", default=None, help="verifier name_or_path written on export (default: the --target value)"
    )
    parser.add_argument(
        "--window-mode",
        choices=WINDOW_MODES,
        default="query",
        help="imported drafter's sliding window: per query as vLLM serves (default) or anchored at the block",
    )
    f = parser.parse_args(argv)
    if f.format == "drafter" and f.target is None:
        parser.error("--format drafter (import from speculators, or re-save a drafter) needs --target")
    if f.format == "drafter" and f.dtype is not None and not is_drafter_checkpoint(f.source):
        parser.error("--dtype does not apply to importing from speculators (the drafter keeps the target's dtype)")
    return f


def is_drafter_checkpoint(spec: str) -> bool:
    """Whether `spec` (a directory or shipped drafter name) is an hspec-jax drafter checkpoint."""
    return os.path.isfile(os.path.join(resolve_drafter(spec), MANIFEST))


def export_drafter(f) -> int:
    """A drafter checkpoint -> a speculators directory."""
    config = read_drafter_config(f.source)
    target = read_target_config(f.target) if f.target else None
    if target is not None:
        try:
            check_target(config, target)
        except ValueError as e:
            raise CheckpointError(f"{f.source}: {e}") from None
    shapes = drafter_param_shapes(config)
    embed = target.vocab_size * target.hidden_size * 4 if target else 0
    check_output_directory(f.to, needed_bytes=embed + sum(x.size * 4 for x in jax.tree.leaves(shapes)))
    target_params = load_target(f.target)[1] if f.target else None
    config, params, vocab = restore_drafter(f.source, target_params=target_params)
    if target_params is None:
        print("warning: no --target: embed_tokens is left out (the verifier's table is used)", file=sys.stderr)
    verifier = f.verifier or f.target
    export_speculators(f.to, params, config, vocab, target_params, verifier=verifier, dtype=f.dtype)
    print(f"wrote speculators checkpoint of a {config.kind} drafter to {f.to}")
    return 0


def import_drafter(f) -> int:
    """A speculators checkpoint -> a drafter checkpoint directory for the given target."""
    check_output_directory(f.to)
    directory, spec = read_speculators_config(f.source)
    speculators_drafter_config(spec, read_target_config(f.target), window_mode=f.window_mode, path=directory)
    target, target_params = load_target(f.target)
    config, params, vocab = import_speculators(f.source, target, target_params, window_mode=f.window_mode)
    save_drafter(f.to, params, config, vocab, target_rows=target_lm_head(target_params, config, vocab))
    print(f"wrote {config.kind} drafter ({spec['speculators_model_type']}) for {target.model_type} to {f.to}")
    return 0


def resave_drafter(f) -> int:
    """A drafter checkpoint -> the same drafter in `--dtype`, its lm_head left to the target where equal, with the
    source's `training.json` (a training run's record) copied beside it."""
    check_output_directory(f.to)
    target, target_params = load_target(f.target)
    config, params, vocab = restore_drafter(f.source, target, target_params)
    dtype = None if f.dtype is None else jax.numpy.dtype(f.dtype)
    save_drafter(f.to, params, config, vocab, dtype=dtype, target_rows=target_lm_head(target_params, config, vocab))
    record = os.path.join(resolve_drafter(f.source), TRAINING_RECORD)
    if os.path.isfile(record):
        shutil.copyfile(record, os.path.join(f.to, TRAINING_RECORD))
    stored = "as stored" if f.dtype is None else f"in {f.dtype}"
    print(f"wrote {config.kind} drafter {stored} to {f.to}")
    return 0


def main(argv: list[str] | None = None) -> int:
    f = parse_args(argv)
    if f.format == "speculators":
        return export_drafter(f)
    if f.format == "drafter" and is_drafter_checkpoint(f.source):
        return resave_drafter(f)
    if f.format == "drafter":
        return import_drafter(f)
    overrides = {"param_dtype": f.dtype} if f.dtype else {}
    check_output_directory(f.to)
    config = read_target_config(f.source, **overrides)
    shapes = param_shapes(config)
    check_output_directory(f.to, needed_bytes=sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)))
    config, params = load_target(f.source, **overrides)
    try:
        tokenizer = load_tokenizer(f.source)
    except CheckpointError as e:
        print(f"warning: no tokenizer saved ({e})", file=sys.stderr)
        tokenizer = None
    if f.format == "orbax":
        save_target(f.to, params, config, tokenizer)
    else:
        export_hf_target(params, config, f.to, tokenizer=tokenizer)
    print(f"wrote {f.format} checkpoint of {config.model_type} ({config.num_layers} layers) to {f.to}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

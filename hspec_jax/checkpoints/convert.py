"""Convert a target checkpoint to Orbax (default) or to a Hugging Face directory.

python -m hspec_jax.checkpoints.convert --from smollm2 --to /tmp/smollm2-orbax
python -m hspec_jax.checkpoints.convert --from model.gguf --to /tmp/hf-dir --format hf --dtype bfloat16

Every argument is checked before any weights are read: the source exists and its config is readable, the
destination is absent or empty, writable, and has room for the weights. The output directory appears only
when complete; a disk that fills up while writing is reported as "no space left on <dir>".
"""

from __future__ import annotations

import sys

import jax

from hspec_jax.checkpoints.hf import CheckpointError, check_output_directory, export_hf_target
from hspec_jax.checkpoints.orbax_io import save_target
from hspec_jax.checkpoints.sources import load_target, load_tokenizer, read_target_config
from hspec_jax.cli import ArgumentParser, float_dtype, run
from hspec_jax.models import init_params


def parse_args(argv: list[str] | None = None):
    parser = ArgumentParser(prog="python -m hspec_jax.checkpoints.convert", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        help="smollm2, an HF directory, a .gguf file or an Orbax target",
    )
    parser.add_argument("--to", required=True, help="output directory (must not exist or be empty)")
    parser.add_argument("--format", choices=["orbax", "hf"], default="orbax", help="output format")
    parser.add_argument(
        "--dtype", type=float_dtype, default=None, help="store weights in this dtype (e.g. bfloat16); default: keep"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    f = parse_args(argv)
    overrides = {"param_dtype": f.dtype} if f.dtype else {}
    check_output_directory(f.to)
    config = read_target_config(f.source, **overrides)
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
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

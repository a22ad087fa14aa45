"""Convert a target checkpoint to Orbax (default) or to a Hugging Face directory.

python -m hspec_jax.checkpoints.convert --from smollm2 --to /tmp/smollm2-orbax
python -m hspec_jax.checkpoints.convert --from model.gguf --to /tmp/hf-dir --format hf --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys

from hspec_jax.checkpoints.hf import CheckpointError, check_output_directory, export_hf_target
from hspec_jax.checkpoints.orbax_io import save_target
from hspec_jax.checkpoints.sources import load_target, load_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hspec_jax.checkpoints.convert", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        help="smollm2, an HF directory, a .gguf file or an Orbax target",
    )
    parser.add_argument("--to", required=True, help="output directory (must not exist or be empty)")
    parser.add_argument("--format", choices=["orbax", "hf"], default="orbax", help="output format")
    parser.add_argument("--dtype", default=None, help="store weights in this dtype (e.g. bfloat16); default: keep")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    f = parse_args(argv)
    source = f.source
    try:
        check_output_directory(f.to)
        overrides = {"param_dtype": f.dtype} if f.dtype else {}
        config, params = load_target(source, **overrides)
        try:
            tokenizer = load_tokenizer(source)
        except (OSError, ValueError) as e:
            print(f"warning: no tokenizer saved ({e})", file=sys.stderr)
            tokenizer = None
        if f.format == "orbax":
            save_target(f.to, params, config, tokenizer)
        else:
            export_hf_target(params, config, f.to, tokenizer=tokenizer)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {f.format} checkpoint of {config.model_type} ({config.num_layers} layers) to {f.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

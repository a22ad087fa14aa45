#!/usr/bin/env bash
# The accelerator check, in one call (README, "Running on a GPU or TPU"):
#
#   bash benchmarks/device_check.sh [--small] [--out PATH] [--sections kernel,smollm2]
#
# 1. Installs what the machine lacks. A device machine may have no network: wheels carried in .whl/
#    (made on a machine with PyPI by `bash benchmarks/device_wheels.sh`) are installed first, without an
#    index. Then any package still missing is tried from the index, and if jax sees no accelerator,
#    `pip install -U "jax[cuda12]"` is tried (jax 0.10.2 has jax-cuda12-plugin and jax-cuda13-plugin
#    wheels). Each install has a time limit; a failed one is reported and the check goes on.
# 2. Runs `python -m benchmarks.device_check` under a time limit (DEVICE_CHECK_TIMEOUT, default 480 s):
#    each section in its own process, the report rewritten after each one, failures recorded in it.
# With --small (tiny shapes, on CPU, run by the tests) nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${DEVICE_CHECK_SITE:-/tmp/hspec_device_site}

if [[ " $* " != *" --small "* ]]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo "== installing the wheels carried in .whl/"
    timeout 180 "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl \
      && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" || echo "!! installing .whl/ failed"
  fi
  missing=$("$PY" - <<'EOF'
import importlib.util
modules = {"jax": "jax", "flax": "flax", "ml_collections": "ml-collections", "gguf": "gguf",
           "orbax.checkpoint": "orbax-checkpoint", "transformers": "transformers", "safetensors": "safetensors"}
print(" ".join(pkg for mod, pkg in modules.items() if importlib.util.find_spec(mod.split(".")[0]) is None))
EOF
)
  if [[ -n "$missing" ]]; then
    echo "== missing: $missing; trying pip (300 s limit)"
    timeout 300 "$PY" -m pip install -q --retries 1 --timeout 15 $missing || echo "!! could not install: $missing"
  fi
  if ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() == 'cpu')" 2>/dev/null; then
    echo "== jax sees no accelerator here; trying pip install -U 'jax[cuda12]' (300 s limit)"
    timeout 300 "$PY" -m pip install -q --retries 1 --timeout 15 -U "jax[cuda12]" || echo "!! could not install jax[cuda12]"
  fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
timeout "${DEVICE_CHECK_TIMEOUT:-480}" "$PY" -m benchmarks.device_check "$@"

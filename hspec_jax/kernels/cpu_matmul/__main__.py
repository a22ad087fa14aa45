"""`python -m hspec_jax.kernels.cpu_matmul`: build the native kernel now (`make` runs it at install), or say why
it does not run on this machine."""

from hspec_jax.kernels.cpu_matmul import native

reason = native.unavailable_reason()
if reason:
    print(f"packed CPU matmul kernel not built: {reason}")
else:
    native.load()
    print(f"packed CPU matmul kernel: {native.library_path(native.compiler())}")

"""The native kernel (`packed_matmul.cc`): built once with the system's C++ compiler, as an installed extension
is, loaded, and registered as the XLA FFI target `hspec_packed_matmul` on the CPU platform.

    python -m hspec_jax.kernels.cpu_matmul     # build now (`make` does it at install)

The library lies in `build/` beside the source (in the user cache, `$XDG_CACHE_HOME/hspec_jax/kernels/`, where the
package directory is read-only). Its file name carries a hash of everything it is built from (the source, the
compiler command, the jaxlib version, the machine's architecture), so an edited source or another jaxlib never
loads a stale build; deleting the directory is always safe.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

from hspec_jax.machine import cpu_flags
from hspec_jax.user_cache import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("packed_matmul.cc")
TARGET = "hspec_packed_matmul"
FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC")
REQUIRED_CPU_FLAGS = frozenset({"avx2", "fma"})


def compiler() -> str | None:
    """The C++ compiler: `$CXX`, else `g++`, else `c++` (None where none is installed)."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def library_dir() -> Path:
    """`build/` beside the source, or the user cache where the source's directory is not writable."""
    return SOURCE.parent / "build" if os.access(SOURCE.parent, os.W_OK) else user_cache_dir("kernels")


def library_path(cxx: str) -> Path:
    """Where the build for this source, compiler command, jaxlib and architecture lives."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cxx.encode(), " ".join(FLAGS).encode(), jaxlib.__version__.encode()):
        key.update(part)
        key.update(b"\0")
    key.update(platform.machine().encode())
    return library_dir() / f"packed_matmul-{key.hexdigest()[:16]}.so"


def build(cxx: str) -> Path:
    """Compile the library unless this exact build exists; return its path. Written under a temporary name and
    renamed, so processes building at once never load a half-written file."""
    path = library_path(cxx)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    command = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    log.info("building the packed CPU matmul kernel: %s", " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    os.replace(tmp, path)
    return path


def unavailable_reason() -> str | None:
    """Why the native kernel cannot run in this process (None where it can): not the CPU backend, not an x86 CPU
    with AVX2 and FMA, or no C++ compiler to build it with."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, not x86-64"
    missing = REQUIRED_CPU_FLAGS - cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    if compiler() is None:
        return "no C++ compiler (g++, c++ or $CXX) to build it with"
    return None


@functools.cache
def load() -> ctypes.CDLL:
    """Build (if needed), load and register the kernel, once per process; returns the loaded library."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or $CXX) to build the packed CPU matmul kernel")
    library = ctypes.cdll.LoadLibrary(str(build(cxx)))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.HspecPackedMatmul), platform="cpu")
    return library


def vector_bits() -> int:
    """The vector width of the kernel's path on this CPU, chosen by the library at run time: 512 where the CPU has
    AVX-512F (8 rows per pass over a block), else 256 (AVX2, 4 rows per pass); `HSPEC_PACKED_MATMUL_AVX2=1` in the
    environment of the process asks for the AVX2 path."""
    return int(load().HspecPackedMatmulVectorBits())

"""The import structure: the library never reaches up into the command lines, and its layers are one-way.

Every module is parsed (no import runs), so a violation is reported with its module and line even when the
import sits inside a function.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Top-level packages -> the packages none of their modules may import.
FORBIDDEN = {
    "hspec_jax": {"eval", "train", "benchmarks"},
    "train": {"eval", "benchmarks"},
    "benchmarks": {"eval"},
    "eval": {"train", "benchmarks"},
}
# The layers of `hspec_jax`, lowest first: a module may import its own layer and the ones below, never one above.
# Each name is a subpackage or a top-level module of `hspec_jax`, or a sub-subpackage placed apart from its parent.
LAYERS = (
    ("errors", "machine", "parallel", "prompts", "user_cache"),  # no model code; the user cache directory
    ("kernels.cpu_matmul",),  # the packed CPU matmul kernel, which the models' linear layers call
    ("cli", "chat"),  # argument types and exit codes; chat-template encoding
    ("models",),  # target LMs, KV cache
    ("kernels",),  # the other kernels beside their references
    ("drafters",),  # drafter networks and heads
    ("decoding", "checkpoints", "recipes"),  # draft-and-verify engine; checkpoint I/O; recipe configs
    ("serving", "drafter_spec", "target_spec"),  # continuous batching; drafters and targets named on a command line
    ("serve",),  # the OpenAI-compatible HTTP server over the serving engine
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in the file, relative ones resolved."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from pkg import name`: recorded as pkg.name, which is right when the name is a submodule.
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_layers_cover_every_hspec_jax_part():
    parts = {p.relative_to(ROOT / "hspec_jax").with_suffix("").parts[0] for p in modules("hspec_jax")} - {"__init__"}
    named = {name.split(".")[0] for name in LAYER_OF}
    assert parts == named, f"parts missing from LAYERS: {parts - named}; gone: {named - parts}"


def test_no_upward_package_imports():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in modules(package):
            for line, name in imports(path):
                if name.split(".")[0] in forbidden:
                    bad.append(f"{module_name(path)} (line {line}) imports {name}")
    assert not bad, "imports across packages the wrong way:\n" + "\n".join(bad)


def layer_part(parts: list[str]) -> str | None:
    """The LAYERS name of a module `hspec_jax.<parts>`: its sub-subpackage where LAYERS places that apart."""
    nested = ".".join(parts[1:3])
    return nested if nested in LAYER_OF else parts[1] if parts[1] in LAYER_OF else None


def test_hspec_jax_layers_are_one_way():
    bad = []
    for path in modules("hspec_jax"):
        source = module_name(path).split(".")
        if len(source) < 2:
            continue  # hspec_jax/__init__.py
        for line, name in imports(path):
            target = name.split(".")
            if target[0] != "hspec_jax" or len(target) < 2 or layer_part(target) is None:
                continue  # outside hspec_jax, or `from hspec_jax import __version__`
            low, high = layer_part(source), layer_part(target)
            if LAYER_OF[high] > LAYER_OF[low]:
                bad.append(f"{module_name(path)} (line {line}, layer {low}) imports {name} (layer {high}, higher)")
    assert not bad, (
        "hspec_jax imports a higher layer (order: "
        + " < ".join("/".join(n) for n in LAYERS)
        + "):\n"
        + ("\n".join(bad))
    )

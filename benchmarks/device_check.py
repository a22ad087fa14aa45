"""The accelerator check: one run on a GPU (or TPU) machine that says what works there and how fast.

    bash benchmarks/device_check.sh              # on the accelerator machine (installs what it can first)
    python -m benchmarks.device_check --small    # the same plumbing on CPU with tiny shapes, in seconds

Sections, each run in its own subprocess with its own time limit (a crash, an out-of-memory abort or a
hang in one is recorded in the report and the next one still runs):

* environment: device, platform, jax/jaxlib/plugin versions, `nvidia-smi`;
* kernel: the target-KV attention kernel (`impl="pallas"`, the platform's variant) against the reference at
  SmolLM2 and Qwen3-8B attention shapes (Llama-3.1-8B's equal Qwen3-8B's), contexts 1k/8k/32k, batch
  1/8/32, block T = 8, bf16: max error of each against an fp32 reference, times, and the kernel's context
  read rate; plus `jax.grad` through the kernel path against the reference's gradient. If every shape
  matches, the report says so: that is the evidence for adding the platform to `VERIFIED_PLATFORMS`;
* smollm2 / llama8b: one plain decoding step T_T(1), one verification T_T(8) and each drafter's T_D(7)
  (H-Spec, DSpark, DFlash, random weights), all from `benchmarks.spec_overhead.isolated_step_times`, for
  SmolLM2 (the embedded weights if the package is installed, else random; drafter attention through the
  reference and, separately, through the kernel) and a random-weight Llama-3.1-8B-shaped target (reference
  attention, what `impl="auto"` runs until the kernel is verified), bf16 on accelerators.

Writes `benchmarks/results/device_<device>.md` (or `--out`), rewritten after every section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback

SECTIONS = {"environment": 40, "kernel": 160, "smollm2": 110, "llama8b": 150}  # name: seconds allowed
SMALL_SECTION_SECONDS = 240
BUDGET_SECONDS = 465  # the whole run (device_check.sh kills it at 480 s): later sections get what is left
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt", "flax")


def environment(small: bool):
    """Device, versions and `nvidia-smi`."""
    import importlib.metadata

    import jax

    from hspec_jax.machine import cpu_model

    devices = jax.devices()
    versions = []
    for name in PACKAGES:
        try:
            versions.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    lines = [
        f"- device: {devices[0].device_kind} x {len(devices)} (platform `{jax.default_backend()}`)",
        f"- python {platform.python_version()}, {os.cpu_count()} CPUs, {cpu_model()}",
        f"- packages: `{' '.join(versions)}`",
    ]
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
        lines += ["", "```", smi.rstrip(), "```"]
    except (OSError, subprocess.TimeoutExpired) as e:
        lines.append(f"- nvidia-smi: not available ({type(e).__name__})")
    yield lines, {"device": devices[0].device_kind, "platform": jax.default_backend()}


def kernel(small: bool):
    """Kernel vs reference: errors against fp32, times, read rate; and gradients through the kernel path.
    Yields the report so far after every shape."""
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks.common import median_time
    from hspec_jax.kernels.target_kv_attention import reference, target_kv_attention, visible_range

    platform_name = jax.default_backend()
    dtype = jnp.float32 if platform_name == "cpu" else jnp.bfloat16
    if small:
        shapes, contexts, batches, repeats = {"tiny (6, 2, 16)": (6, 2, 16)}, (40,), (2,), 2
    else:
        shapes = {"SmolLM2 (9, 3, 64)": (9, 3, 64), "Qwen3-8B (32, 8, 128)": (32, 8, 128)}
        contexts, batches, repeats = (1024, 8192, 32768), (1, 8, 32), 10
    t = 8
    attend = {
        impl: jax.jit(functools.partial(target_kv_attention, window=None, impl=impl))
        for impl in ("pallas", "reference")
    }
    exact = jax.jit(functools.partial(reference, window=None))
    head = [
        f"Block T = {t}, one block per sequence, anchors uniform in [S/2, S], no window, {jnp.dtype(dtype).name}; "
        "errors are max |out - fp32 reference|; times are medians of jitted calls; read rate = visible context "
        "K+V bytes / kernel time.",
        "",
        "| heads (N, K, H) | context S | batch | kernel error | reference error | match | kernel ms | reference ms "
        "| speedup | kernel GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows, matched = [], True
    for (name, (heads, kv_heads, head_dim)), s, b in (
        (shape, s, b) for shape in shapes.items() for s in contexts for b in batches
    ):
        ks = jax.random.split(jax.random.key(s + b), 6)
        q = jax.random.normal(ks[0], (b, 1, t, heads, head_dim), dtype)
        k_blk, v_blk = (jax.random.normal(k, (b, 1, t, kv_heads, head_dim), dtype) for k in ks[1:3])
        k_ctx, v_ctx = (jax.random.normal(k, (b, s, kv_heads, head_dim), dtype) for k in ks[3:5])
        anchors = jax.random.randint(ks[5], (b, 1), s // 2, s + 1)  # ragged, most of the context visible
        args = (q, k_blk, v_blk, k_ctx, v_ctx, anchors)
        want = exact(*(x.astype(jnp.float32) for x in args[:5]), anchors)
        errors, times = {}, {}
        for impl, fn in attend.items():
            out = jax.block_until_ready(fn(*args))
            errors[impl] = float(jnp.abs(out.astype(jnp.float32) - want).max())
            times[impl] = median_time(lambda fn=fn, args=args: jax.block_until_ready(fn(*args)), repeats)
        del want
        lo, hi = visible_range(anchors, s, None)
        read = float(jnp.sum(hi - lo)) * kv_heads * head_dim * 2 * jnp.dtype(dtype).itemsize
        ok = errors["pallas"] <= max(2 * errors["reference"], 1e-2 if dtype == jnp.bfloat16 else 1e-4)
        matched &= ok
        rows.append(
            f"| {name} | {s} | {b} | {errors['pallas']:.2e} | {errors['reference']:.2e} | {'yes' if ok else '**NO**'} "
            f"| {times['pallas'] * 1e3:.3f} | {times['reference'] * 1e3:.3f} "
            f"| {times['reference'] / times['pallas']:.2f}x | {read / times['pallas'] / 1e9:.0f} |"
        )
        print(rows[-1], flush=True)
        yield [*head, *rows], {"kernel_matched": matched}
    grad_error = None if small else gradient_check(dtype)
    grad_line = (
        "`jax.grad` through the kernel path: not run with --small (tests/test_target_kv_attention.py checks it)."
        if grad_error is None
        else f'`jax.grad` through `impl="pallas"` vs the reference\'s gradient (all five float inputs): max error '
        f"{grad_error:.2e}."
    )
    verdict = (
        f"**Kernel {'matched' if matched else 'did NOT match'} the reference at every shape** on `{platform_name}`"
    )
    if platform_name == "cpu":
        verdict += " (interpret mode: says nothing about compiled kernels)."
    elif matched:
        verdict += f": evidence for adding '{platform_name}' to `VERIFIED_PLATFORMS`."
    yield (
        [
            *head,
            *rows,
            "",
            grad_line,
            "",
            verdict,
        ],
        {"kernel_matched": matched, "grad_error": grad_error},
    )


def gradient_check(dtype) -> float:
    """Max |grad(kernel path) - grad(reference)| over q, block K/V and context K/V, at a small shape."""
    import functools

    import jax
    import jax.numpy as jnp

    from hspec_jax.kernels.target_kv_attention import target_kv_attention

    ks = jax.random.split(jax.random.key(0), 6)
    shapes = [(2, 2, 8, 6, 64), (2, 2, 8, 2, 64), (2, 2, 8, 2, 64), (2, 100, 2, 64), (2, 100, 2, 64)]
    inputs = [jax.random.normal(k, shape, dtype) for k, shape in zip(ks, shapes, strict=False)]
    anchors = jnp.array([[0, 100], [37, 64]])
    weights = jax.random.normal(ks[5], shapes[0], jnp.float32)

    def loss(impl, *x):
        out = target_kv_attention(*x, anchors, window=48, impl=impl)
        return (weights * out.astype(jnp.float32)).sum()

    argnums = tuple(range(5))
    got = jax.jit(jax.grad(functools.partial(loss, "pallas"), argnums))(*inputs)
    want = jax.jit(jax.grad(functools.partial(loss, "reference"), argnums))(*inputs)
    return max(
        float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max()) for g, w in zip(got, want, strict=True)
    )


def step_times(recipe_path: str, embedded: str | None, impls: tuple[str, ...], small: bool):
    """T_T(1), T_T(8) and each drafter's T_D(7), batch 1, once per drafter attention impl (each measurement
    in its own try: a kernel that fails to compile leaves the reference rows). Yields after each impl."""
    import jax
    import numpy as np

    from benchmarks.spec_overhead import KINDS, isolated_step_times
    from hspec_jax.drafters import build_draft_vocab, init_drafter, init_from_target
    from hspec_jax.models import init_params
    from hspec_jax.recipes import drafter_from_recipe, load_config, target_config

    recipe = load_config("configs/tiny.py" if small else recipe_path)
    weights = "random"
    target = params = None
    if embedded and not small:
        try:
            from hspec_jax.checkpoints import load_target

            target, params = load_target(embedded)
            weights = f"embedded `{embedded}`"
        except Exception as e:  # the package may not be installed on the device machine
            weights = f"random (embedded weights unavailable: {type(e).__name__}: {str(e)[:200]})"
    if target is None:
        target = target_config(recipe)
        params = init_params(target, jax.random.key(0))
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    context = 64 if small else 1024
    tokens = np.random.default_rng(0).integers(0, target.vocab_size, 20000)
    lines = [
        f"Target: `{recipe.target.name}`, {sum(x.size for x in jax.tree.leaves(params)) / 1e9:.3f} B parameters, "
        f"{target.dtype.name}, weights {weights}; drafters random; batch 1, context {context}.",
    ]
    facts = {}
    for impl in impls:
        label = "kernel" if impl == "pallas" else "reference"
        try:
            drafters = {}
            for kind in ("hspec",) if small else KINDS:
                config = drafter_from_recipe(recipe, kind, target).replace(attention_impl=impl)
                vocab = build_draft_vocab(tokens, target.vocab_size, config.vocab_size, always=target.eos_token_ids)
                dparams = init_from_target(init_drafter(config, jax.random.key(1)), config, params, vocab)
                drafters[kind] = (config, dparams, vocab)
            times = isolated_step_times(target, params, drafters, context=context, repeats=3 if small else 20)
        except Exception:
            lines += ["", f"### drafters with {label} attention: **FAILED**", "", "```"]
            lines += [traceback.format_exc()[-6000:].rstrip(), "```"]
            facts["failed"] = True
            yield lines, facts
            continue
        t1 = times["T_T(1)"]
        k = next(iter(drafters.values()))[0].num_drafts
        verify = times[f"T_T({k + 1})"]
        lines += [
            "",
            f"### drafters with {label} attention",
            "",
            f"One plain step reads the weights once: {weight_bytes / t1 / 1e9:.0f} GB/s of weights. "
            f"T_T({k + 1}) / T_T(1) = **{verify / t1:.2f}**.",
            "",
            "| piece | ms | / T_T(1) | step T_T(8) + T_D(7) vs plain step |",
            "|---|---|---|---|",
            *(
                f"| {name} | {t * 1e3:.3f} | {t / t1:.2f} | "
                + (f"{(verify + t) / t1:.2f}x |" if name.startswith("T_D") else "|")
                for name, t in times.items()
            ),
        ]
        facts[f"T_T(1) {label}"] = t1
        facts[f"verify_ratio {label}"] = verify / t1
        yield lines, facts


def run_section(name: str, small: bool):
    """The section's generator of (report lines so far, facts)."""
    if name == "environment":
        return environment(small)
    if name == "kernel":
        return kernel(small)
    if name == "smollm2":
        return step_times("configs/smollm2.py", "smollm2", ("reference", "pallas"), small)
    if name == "llama8b":
        return step_times("configs/llama.py", None, ("reference",), small)
    raise ValueError(f"unknown section {name!r}; choose from {tuple(SECTIONS)}")


def section_main(name: str, small: bool, part: str) -> None:
    """Child process: run one section, rewriting {"lines", "facts"} in `part` as it goes (failures included)."""

    def write(lines, facts):
        with open(part + ".tmp", "w") as f:
            json.dump({"lines": lines, "facts": facts}, f)
        os.replace(part + ".tmp", part)

    lines, facts = [], {}
    try:
        for lines, facts in run_section(name, small):
            write(lines, facts)
    except Exception:
        failure = ["", "**FAILED**", "", "```", traceback.format_exc()[-8000:].rstrip(), "```"]
        write([*lines, *failure], {**facts, "failed": True})


def spawn(name: str, small: bool, limit: float) -> tuple[list[str], dict]:
    """Run a section in a child process under a time limit; a crash or timeout becomes report text."""
    with tempfile.TemporaryDirectory() as tmp:
        part = os.path.join(tmp, "part.json")
        cmd = [sys.executable, "-u", "-m", "benchmarks.device_check", "--section", name, "--part", part]
        cmd += ["--small"] if small else []
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            output, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            text = lambda x: x.decode(errors="replace") if isinstance(x, bytes) else x or ""
            output, code = text(e.stdout) + text(e.stderr) + f"\n(killed after {limit:.0f} s)", None
        elapsed = time.perf_counter() - start
        lines, facts = [], {}
        if os.path.exists(part):
            with open(part) as f:
                result = json.load(f)
            lines, facts = result["lines"], result["facts"]
        if code != 0:
            status = "timed out" if code is None else f"exit code {code}"
            lines = [*lines, "", f"**FAILED** ({status}; what is above was complete); output tail:", ""]
            lines += ["```", output[-8000:].rstrip(), "```"]
            facts = {**facts, "failed": True}
    print(f"[{name}] {elapsed:.0f} s" + (" FAILED" if facts.get("failed") else ""), flush=True)
    return [*lines, "", f"_section time {elapsed:.0f} s_"], facts


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes: the plumbing on CPU in seconds")
    parser.add_argument("--out", help="report path (default benchmarks/results/device_<device>.md)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of sections")
    parser.add_argument("--budget", type=float, default=BUDGET_SECONDS, help="seconds for the whole run")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # child process: run this one section
    parser.add_argument("--part", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        section_main(args.section, args.small, args.part)
        return
    names = args.sections.split(",")
    if unknown := [n for n in names if n not in SECTIONS]:
        parser.error(f"unknown sections {unknown}; choose from {tuple(SECTIONS)}")
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    command = "python -m benchmarks.device_check " + " ".join(argv if argv is not None else sys.argv[1:])
    body, device, out = [], "unknown", args.out
    deadline = time.perf_counter() + args.budget
    for name in names:
        left = deadline - time.perf_counter()
        if left < 10:
            lines, facts = [f"**NOT RUN**: the {args.budget:.0f} s budget was used up."], {}
        else:
            lines, facts = spawn(name, args.small, min(SMALL_SECTION_SECONDS if args.small else SECTIONS[name], left))
        device = facts.get("device", device)
        out = out or f"benchmarks/results/device_{slug(device)}.md"
        body += [f"## {name}", "", *lines, ""]
        header = [f"# Device check: {device}", "", f"Command: `{command.strip()}`, started {started}."]
        header[-1] += " **--small: tiny shapes, plumbing only.**" if args.small else ""
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write("\n".join([*header, "", *body]) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Where the milliseconds of one decoding step go on CPU: per-operation times from a `jax.profiler` trace.

    python -m benchmarks.step_profile [--calls 10] [--out benchmarks/results/step_profile.md]

For each piece (the SmolLM2 target forward at T = 1 and T = 8 tokens, at context 64 and 1024, the H-Spec
drafter step with its token choice, and one draft-and-verify step of the engine's loop), the compiled program
is traced for `--calls` calls. XLA's CPU runtime records one event per executed thunk (a dot, a fusion, a copy,
a loop); each event is matched by name to the optimised HLO, whose metadata says which model operation it
came from (`.../layers_3/mlp/gate_proj/dot_general`), and summed per category. Thunks of one call can run on
both cores at once, so the category times are thread time (they may add up to more than the wall time).
Writes `benchmarks/results/step_profile.md`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib import _profile_data

from benchmarks.common import write_report
from hspec_jax.checkpoints import load_target
from hspec_jax.decoding import Bundle, SamplingConfig
from hspec_jax.decoding.speculative import draft_next, spec_decode_chunk, spec_prefill
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.api import decoding_inputs
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.machine import cpu_model
from hspec_jax.models import forward, init_cache
from hspec_jax.models.layers import for_backend
from hspec_jax.recipes import drafter_from_recipe, load_config

# (category, pattern on the HLO op_name metadata); the first match wins; the rest is the last category.
CATEGORIES = (
    ("drafter Mamba-2 + seed fusion", r"HSpec/(layers_\d+/(ssm|ssm_norm)/|fc(/|$)|hidden_norm/|seed_projs)"),
    ("drafter attention (target KV)", r"HSpec/layers_\d+/(self_attn|input_layernorm)/"),
    ("drafter MLP", r"HSpec/layers_\d+/(mlp|mlp_norm)/"),
    ("drafter lm_head, norms, residuals", r"HSpec/"),
    ("q/k/v projections", r"DecoderLayer/.*(qkv|[qkv])_proj($|/dot_general)"),
    ("RoPE", r"DecoderLayer/.*self_attn\.(query|key_value)/"),
    ("KV cache write", r"DecoderLayer/.*self_attn/scatter"),
    ("o projection", r"DecoderLayer/.*o_proj"),
    ("attention over the cache", r"DecoderLayer/self_attn/"),
    ("MLP gate/up + SiLU", r"DecoderLayer/.*(gate_up_proj|gate_proj|up_proj|mlp/mul|mlp/jit\(silu\)|mlp/split)"),
    ("MLP down", r"DecoderLayer/.*down_proj"),
    ("RMSNorms + residual adds", r"DecoderLayer/.*(layernorm|norm/|add)"),
    ("lm_head (49152 x 576)", r"Decoder/.*d,vd->\.\.\.v"),
    ("embedding gather, other target", r"Decoder(Layer)?/"),
)
REST = "token choice (Markov scan), acceptance, bookkeeping"
# Instruction line of an optimised HLO module: `%name = shape opcode(...)..., metadata={op_name="..."`.
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")
OP_NAME = re.compile(r'op_name="([^"]*)"')
# A weight operand, `%p__layers_3____mlp____gate_proj____kernel__.1` (target params `p`, drafter params `d`).
WEIGHT = re.compile(r"%([pd])__((?:layers_\d+____)?\w+?)(?:____kernel)?__(?:\.\d+)?[,)]")


def categorise(op_name: str, instruction: str) -> str | None:
    """The category of one executed instruction; None for loops and calls (their events span their bodies,
    whose own thunks are counted)."""
    if instruction.startswith(("while", "conditional", "call")):
        return None
    if instruction.startswith(("copy", "transpose")):
        return "copies + transposes (layout changes)"
    for category, pattern in CATEGORIES:
        if re.search(pattern, op_name):
            return category
    return REST


def hlo_names(compiled_text: str) -> dict[str, str]:
    """Instruction name -> op_name metadata ('' where there is none), over every computation of the module."""
    names = {}
    for line in compiled_text.splitlines():
        match = INSTRUCTION.match(line)
        if match:
            op_name = OP_NAME.search(line)
            weight = WEIGHT.search(line)
            if op_name:
                names[match.group(1)] = op_name.group(1)
            elif weight:  # a dot that lost its metadata (single-row products): name it by the weight it reads
                scope = "Decoder" if weight.group(1) == "p" else "HSpec"
                path = weight.group(2).replace("____", "/")
                names[match.group(1)] = (
                    f"{scope}/btd,vd->btv" if path == "embed_tokens/embedding" else f"{scope}/{path}"
                )
            else:
                names[match.group(1)] = ""
    return names


def profile(compiled_text: str, call, calls: int) -> tuple[float, dict[str, float], list[tuple[str, float]]]:
    """Trace `calls` calls of `call()` (a compiled program whose optimised HLO is `compiled_text`) ->
    (median wall ms per call, thread ms per call by category, top instructions by thread ms per call)."""
    names = hlo_names(compiled_text)
    jax.block_until_ready(call())
    walls = []
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                start = time.perf_counter()
                jax.block_until_ready(call())
                walls.append(time.perf_counter() - start)
        path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
        data = _profile_data.ProfileData.from_file(path)
    per_instruction = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in names:
                    per_instruction[event.name] += event.duration_ns / 1e6 / calls
    by_category, top = collections.Counter(), []
    for name, ms in per_instruction.most_common():
        category = categorise(names[name], name)
        if category is not None:
            by_category[category] += ms
            top.append((f"{name} ({names[name].split('/', 1)[-1][-60:]})", ms))
    return float(np.median(walls)) * 1e3, dict(by_category), top


def table(results: dict[str, tuple[float, dict[str, float], list]]) -> list[str]:
    cases = list(results)
    categories = sorted(
        {c for _, cats, _ in results.values() for c in cats},
        key=lambda c: -max(results[case][1].get(c, 0.0) for case in cases),
    )
    lines = ["| category | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
    for category in categories:
        cells = []
        for case in cases:
            ms = results[case][1].get(category, 0.0)
            total = sum(results[case][1].values())
            cells.append(f"{ms:.2f} ({100 * ms / total:.0f}%)" if ms else "-")
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    lines.append(
        "| **sum of thunk thread time** | " + " | ".join(f"**{sum(results[c][1].values()):.2f}**" for c in cases) + " |"
    )
    lines.append("| **wall time per call (median)** | " + " | ".join(f"**{results[c][0]:.2f}**" for c in cases) + " |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/step_profile.md")
    args = parser.parse_args(argv)

    target, params = load_target("smollm2")
    drafter = drafter_from_recipe(load_config("smollm2"), "hspec", target)
    k = drafter.num_drafts
    tokens = np.arange(100, 300) % target.vocab_size
    vocab = build_draft_vocab(tokens, target.vocab_size, drafter.vocab_size, always=target.eos_token_ids)
    dparams = init_from_target(init_drafter(drafter, jax.random.key(0)), drafter, params, vocab)
    params, dparams = for_backend(params), for_backend(dparams)  # as the engines run them (fused on CPU)
    embedding = params["embed_tokens"]["embedding"]
    greedy = SamplingConfig()

    def draft_step(b, c, taps):  # the engine's drafting step on the k + 1 rows verified last
        inputs = decoding_inputs(drafter, embedding, jnp.ones((1,), jnp.int32), c, taps, c.lengths - taps.shape[1])
        return draft_next(b, greedy, inputs, jax.random.key(0))[0]

    drafting = Bundle({}, target, dparams, drafter, vocab)
    verified_taps = jnp.ones((1, k + 1, len(drafter.fusion_layer_ids) * target.hidden_size), jnp.float32)
    results, tops = {}, {}
    for context in (64, 1024):
        cache = init_cache(target, 1, context + 64).replace(lengths=jnp.array([context], jnp.int32))
        for width in (1, k + 1):
            taps = drafter.fusion_layer_ids if width > 1 else ()
            fn = jax.jit(lambda p, c, w=width, taps=taps: forward(p, target, jnp.ones((1, w), jnp.int32), c, taps))
            name = f"T_T({width}) @{context}"
            compiled = fn.lower(params, cache).compile()
            results[name] = profile(compiled.as_text(), lambda c=compiled, cache=cache: c(params, cache), args.calls)
            tops[name] = results[name][2]
            print(name, f"{results[name][0]:.2f} ms", flush=True)
        name = f"T_D({k}) @{context}"
        compiled = jax.jit(draft_step).lower(drafting, cache, verified_taps).compile()
        results[name] = profile(
            compiled.as_text(), lambda c=compiled, cache=cache: c(drafting, cache, verified_taps), args.calls
        )
        tops[name] = results[name][2]
        print(name, f"{results[name][0]:.2f} ms", flush=True)

    # One chunk of 8 engine steps (draft-and-verify inside the while loop), per step.
    prompt = jnp.asarray(tokens[None, :64].astype(np.int32))
    kw = dict(max_new_tokens=512, sampling=greedy, eos_ids=(), pad_id=0)
    bundle = Bundle(params, target, dparams, drafter, vocab)
    cache = init_cache(target, 1, 64 + 512 + k + 1)
    state, cache, context = spec_prefill(bundle, prompt, jnp.array([64]), cache, (), jax.random.key(0), **kw)
    compiled = spec_decode_chunk.lower(bundle, state, cache, context, jnp.int32(8), **kw).compile()
    carry = [state, cache, context]

    def chunk():  # the caches are donated: each call continues from the last one's output
        carry[:] = compiled(bundle, *carry, jnp.int32(8))
        return carry

    wall, cats, top = profile(compiled.as_text(), chunk, max(2, args.calls // 4))
    results["engine step @64 (of a chunk of 8)"] = (wall / 8, {c: ms / 8 for c, ms in cats.items()}, top)
    tops["engine step @64 (of a chunk of 8)"] = [(label, ms / 8) for label, ms in top]

    lines = [
        "# Where a decoding step's time goes (SmolLM2-135M-Instruct fp32, H-Spec k = 7, CPU)",
        "",
        f"Command: `python -m benchmarks.step_profile --calls {args.calls}`  ",
        f"Machine: {cpu_model()}, jax {jax.__version__}. Per-thunk events of a `jax.profiler` trace, matched to "
        "the optimised HLO's op_name metadata; thread ms per call (thunks of one call may run on both cores at "
        "once, so a column can add up to more than its wall time). `@S`: context length (committed cache rows).",
        "",
        *table(results),
        "",
        "## Largest single operations (thread ms per call)",
        "",
    ]
    for name, top in tops.items():
        lines += [f"**{name}**: " + "; ".join(f"`{label}` {ms:.2f}" for label, ms in top[:8]), ""]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()

"""What one draft-and-verify step costs on CPU, and the speedup any mean accepted length would give.

    python -m benchmarks.spec_overhead [--new-tokens 96] [--repeats 3]

On the embedded SmolLM2 target, same prompts, same run:
(a) end to end: plain greedy decoding vs speculative decoding with randomly initialised drafters (tau ~ 1),
    which shows the pure overhead of drafting and of verifying k+1 = 8 positions instead of 1;
(b) the per-step breakdown, each jitted and timed alone: T_T(1) (one target forward of one token),
    T_T(k+1) (verification) and T_D(k) per drafter, and the step as measured inside the engine's loop.
With the paper's latency model, speedup(tau) = tau * T_AR / T_step, where T_AR and T_step are the
in-loop per-token and per-step times. Writes `benchmarks/results/spec_overhead.md`.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import PROMPTS, median_time, write_report
from hspec_jax.chat import chat_prompt_ids
from hspec_jax.checkpoints import load_target, load_tokenizer
from hspec_jax.decoding import Bundle, SamplingConfig, pad_batch
from hspec_jax.decoding.engine import compile_autoregressive, compile_speculative, generate_streaming
from hspec_jax.decoding.speculative import draft_next
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.api import decoding_inputs
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.family import compared_kinds
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.machine import cpu_model
from hspec_jax.models import forward, init_cache
from hspec_jax.recipes import drafter_from_recipe, load_config

KINDS = compared_kinds()
GREEDY = SamplingConfig()


def isolated_step_times(target, target_params, drafters, context: int, repeats: int) -> dict[str, float]:
    """T_T(1), T_T(k+1) and each drafter's T_D(k) (draft + token choice), each jitted alone. The target's steps
    donate the cache and get it back, as in the engines (an undonated step would copy every layer's K and V)."""
    k = next(iter(drafters.values()))[0].num_drafts
    cache = init_cache(target, 1, context + 64).replace(lengths=jnp.array([context], jnp.int32))
    times = {}
    for name, width in (("T_T(1)", 1), (f"T_T({k + 1})", k + 1)):
        taps = next(iter(drafters.values()))[0].fusion_layer_ids if width > 1 else ()

        def target_step(p, c, w=width, taps=taps):
            out = forward(p, target, jnp.ones((1, w), jnp.int32), c, taps)
            return out.logits, out.hidden, out.cache  # rows written, lengths unchanged: the same step again

        fn = jax.jit(target_step, donate_argnums=1)
        held = {"cache": jax.tree.map(jnp.copy, cache)}

        def call(fn=fn, held=held):
            *out, held["cache"] = fn(target_params, held["cache"])
            jax.block_until_ready(out)

        call()
        times[name] = median_time(call, repeats)
    embedding = target_params["embed_tokens"]["embedding"]
    for kind, (config, params, vocab) in drafters.items():
        # The engine's drafting step after a verification of k + 1 rows (the last k + 1 rows of the cache).
        taps = jnp.ones((1, k + 1, len(config.fusion_layer_ids) * target.hidden_size), jnp.float32)
        anchor = jnp.ones((1,), jnp.int32)

        def step(bundle, c, ctx, taps=taps, anchor=anchor):
            inputs = decoding_inputs(bundle.drafter, embedding, anchor, c, taps, c.lengths - taps.shape[1], ctx)
            return draft_next(bundle, GREEDY, inputs, jax.random.key(0))

        bundle = Bundle({}, target, params, config, vocab)
        ctx = drafter_context(config, 1, context + 64)
        fn = jax.jit(step)
        jax.block_until_ready(fn(bundle, cache, ctx))
        times[f"T_D({k}) {kind}"] = median_time(
            lambda fn=fn, b=bundle, ctx=ctx: jax.block_until_ready(fn(b, cache, ctx)), repeats
        )
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/spec_overhead.md")
    args = parser.parse_args(argv)
    n = args.new_tokens

    target, target_params = load_target("smollm2")
    tokenizer = load_tokenizer("smollm2")
    recipe = load_config("configs/smollm2.py")
    prompts = [chat_prompt_ids(tokenizer, p) for p in PROMPTS]
    vocab_tokens = np.concatenate(prompts)
    drafters = {}
    for kind in KINDS:
        config = drafter_from_recipe(recipe, kind, target)
        vocab = build_draft_vocab(vocab_tokens, target.vocab_size, config.vocab_size, always=target.eos_token_ids)
        params = init_from_target(init_drafter(config, jax.random.key(0)), config, target_params, vocab)
        drafters[kind] = (config, params, vocab)
    k = drafters["hspec"][0].num_drafts

    rows, per_token, per_step = [], [], {kind: [] for kind in KINDS}
    for text, ids in zip(PROMPTS, prompts, strict=True):
        tokens, lengths = pad_batch([ids])
        kw = dict(max_new_tokens=n, sampling=GREEDY, eos_ids=(), pad_id=0, seed=0)
        ar = compile_autoregressive(target_params, target, tokens, lengths, len(ids) + n, **kw)
        ar_out = generate_streaming(ar, n).tokens
        t_ar = float(np.median([generate_streaming(ar, n).seconds for _ in range(args.repeats)]))
        per_token.append(t_ar / n)
        cells = []
        for kind, (config, params, vocab) in drafters.items():
            bundle = Bundle(target_params, target, params, config, vocab)
            spec = compile_speculative(bundle, tokens, lengths, len(ids) + n + k + 1, **kw)
            runs = [generate_streaming(spec, n) for _ in range(args.repeats)]
            out, stats = runs[0].tokens, runs[0].stats
            assert np.array_equal(out, ar_out), f"{kind} changed the greedy output"
            t_spec = float(np.median([r.seconds for r in runs]))
            steps = int(stats.steps[0])
            per_step[kind].append(t_spec / steps)
            cells.append(f"{n / t_spec:.1f} ({stats.tau():.2f}, {t_spec / t_ar:.2f}x)")
        rows.append(f"| {text[:36]} | {n / t_ar:.1f} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)

    t_ar = float(np.median(per_token))
    iso = isolated_step_times(target, target_params, drafters, context=64, repeats=max(10, args.repeats))
    step_rows = [f"| {name} | {t * 1e3:.2f} | {t / iso['T_T(1)']:.2f} |" for name, t in iso.items()]
    loop_rows, model_rows = [], []
    for kind in KINDS:
        t_step = float(np.median(per_step[kind]))
        loop_rows.append(f"| {kind} | {t_step * 1e3:.2f} | {t_step / t_ar:.2f}x |")
        speedups = [tau * t_ar / t_step for tau in (1, 2, 3, 4, 5, 6, 8)]
        needed = t_step / t_ar * 1.8
        model_rows.append(f"| {kind} | " + " | ".join(f"{s:.2f}x" for s in speedups) + f" | {needed:.2f} |")
    hspec_ratio = float(np.median(per_step["hspec"])) / t_ar
    lines = [
        "# Speculative decoding overhead on CPU (SmolLM2-135M-Instruct, fp32, k = 7)",
        "",
        f"Command: `python -m benchmarks.spec_overhead --new-tokens {n} --repeats {args.repeats}`  ",
        f"Machine: {cpu_model()}, {os.cpu_count()} CPUs, jax {jax.__version__}. Drafters are randomly "
        "initialised (tau ~ 1), so this measures cost, not acceptance; every run's tokens equal plain greedy "
        "decoding (checked).",
        "",
        "## (a) End to end, batch 1, greedy, tokens/s (tau, time relative to plain decoding)",
        "",
        "| prompt | plain | " + " | ".join(f"{kind} + verify" for kind in KINDS) + " |",
        "|---|---|" + "---|" * len(KINDS),
        *rows,
        "",
        "## (b) Per-step costs",
        "",
        "Each function jitted and timed alone (context 64):",
        "",
        "| piece | ms | / T_T(1) |",
        "|---|---|---|",
        *step_rows,
        "",
        f"Inside the engine's loop (median over prompts): plain decoding costs **{t_ar * 1e3:.2f} ms per token**; "
        "one draft-and-verify step costs:",
        "",
        "| drafter | ms per step | vs one plain step |",
        "|---|---|---|",
        *loop_rows,
        "",
        "Latency model: speedup(tau) = tau x T_AR / T_step.",
        "",
        "| drafter | tau=1 | 2 | 3 | 4 | 5 | 6 | 8 | tau needed for 1.8x |",
        "|---|---|---|---|---|---|---|---|---|",
        *model_rows,
        "",
        f"Goal (issue): a step at most 1.6x a plain step. Measured for H-Spec: **{hspec_ratio:.2f}x** "
        f"({'met' if hspec_ratio <= 1.6 else 'not met'}). Verifying 8 positions is itself "
        f"{iso[f'T_T({k + 1})'] / iso['T_T(1)']:.2f}x a single-token forward on this 2-core CPU: at 8 rows the "
        "target's matmuls are no longer bound by reading the weights but by arithmetic, which leaves little "
        "room for the drafter within 1.6x.",
    ]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()

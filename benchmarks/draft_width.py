"""What drafting only the slots a step may verify saves: `--k auto`'s steps pinned to one width, narrow or not.

    python -m benchmarks.draft_width [--drafter smollm2-hspec-cut] [--rounds 30] [--capacity 512]
        [--out benchmarks/results/draft_width.md]

One process loads the embedded SmolLM2 target and the drafter and compiles the `--k auto` engine with the CPU
choices (0, 3, k) twice: drafting each block only as far as the step verifies (`AdaptivePolicy.narrow`) and
drafting all k slots whatever the step verifies (the default). Each variant's cost table
is pinned to one choice (`policy.pinned_costs`): plain steps, drafts of 3, drafts of k. Every round times 8 steps of
each variant (after a fresh prefill of one 40-token prompt and 2 untimed steps; the order reversed every other
round) in one generation of at most 400 tokens with EOS ignored; the medians over rounds give ms per step and each
width's cost over the plain step's, T(k) / T(0), what the policy's cost table holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from benchmarks.common import write_report
from hspec_jax.machine import cpu_model

PROMPT_TOKENS, TIMED_STEPS = 40, 8


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default="smollm2-hspec-cut")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results/draft_width.md")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from hspec_jax.checkpoints import load_target
    from hspec_jax.checkpoints.drafter_io import restore_drafter
    from hspec_jax.decoding import Bundle, pad_batch
    from hspec_jax.decoding.bundle import init_caches
    from hspec_jax.decoding.placement import Placement
    from hspec_jax.decoding.policy import AdaptivePolicy, pinned_costs
    from hspec_jax.decoding.speculative import spec_decode_chunk, spec_prefill

    target, target_params = load_target("smollm2")
    drafter, drafter_params, vocab = restore_drafter(args.drafter, target, target_params)
    bundle = Placement(None, target).bundle(Bundle(target_params, target, drafter_params, drafter, vocab))
    narrow = AdaptivePolicy.for_drafts(drafter.num_drafts, "cpu", narrow=True)
    whole = dataclasses.replace(narrow, narrow=False)
    prompt = np.random.default_rng(0).integers(100, target.vocab_size, PROMPT_TOKENS).tolist()
    tokens, lengths = (jnp.asarray(a) for a in pad_batch([prompt], length=64))
    k = drafter.num_drafts
    variants = {"plain step": (narrow, 0)}
    for index, drafts in enumerate(narrow.choices[1:], 1):
        variants[f"k = {drafts}, {drafts} slots drafted"] = (narrow, index)
        if drafts < k:
            variants[f"k = {drafts}, all {k} slots drafted"] = (whole, index)

    def steps(name: str, count: int, carry=None):
        policy, index = variants[name]
        kw = dict(max_new_tokens=400, policy=policy, eos_ids=())
        if carry is None:
            caches = init_caches(bundle, 1, args.capacity)
            costs = pinned_costs(policy, index)
            carry = spec_prefill(bundle, tokens, lengths, *caches, jax.random.key(0), costs, **kw)
        return jax.block_until_ready(spec_decode_chunk(bundle, *carry, count, **kw))

    names = list(variants)
    for name in names:  # compile and warm up
        steps(name, 4, steps(name, 2))
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            carry = steps(name, 2)
            first = int(carry[0].step)
            began = time.perf_counter()
            carry = steps(name, TIMED_STEPS, carry)
            times[name].append((time.perf_counter() - began) / (int(carry[0].step) - first))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    plain = ms["plain step"]
    lines = [
        "# Drafting only the slots a step verifies (`AdaptivePolicy.narrow`)",
        "",
        f"CPU: {cpu_model()}, 2 cores; jax {jax.__version__}. Command: `python -m benchmarks.draft_width --drafter "
        f"{args.drafter} --rounds {args.rounds} --capacity {args.capacity}`. SmolLM2 target, drafter "
        f"`{args.drafter}` (k = {k}), batch 1, greedy, cache of {args.capacity} rows, `--k auto`'s steps pinned to "
        f"one width; median of {args.rounds} interleaved rounds of {TIMED_STEPS} steps.",
        "",
        "| step | ms per step | over a plain step |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {ms[name]:.2f} | {ms[name] / plain:.3f} |" for name in names]
    write_report(args.out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

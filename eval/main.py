"""Evaluate drafters: tau, per-position acceptance and wall-clock speedup over plain decoding on eight tasks.

    python -m eval.main --target smollm2 --drafter random:hspec --drafter random:dspark --num-prompts 4 \\
        --out runs/eval-smoke

For every prompt of the chosen tasks (`hspec_jax.prompts`: math, qa, dialogue, rag, summarization, translation, code,
tool_use), plain decoding and then each drafter generate up to `--max-new-tokens` tokens per turn, in one
process, interleaved prompt by prompt. Multi-turn prompts (MT-bench) are answered turn by turn, each method's second
turn seeing its own first answer. Prompt width and KV capacity are bucketed (`hspec_jax.decoding.bucketed_shapes`)
and every shape is compiled ahead of time before its first timed call, so no compilation is ever timed.

Writes into `--out`:
  results.jsonl  one row per prompt x method x turn (fields: `eval.report`), written as the run goes
  meta.json      command, machine, settings, methods (`python -m eval.report DIR` rewrites the report from these)
  report.md      machine facts, tau, acceptance by draft index, tokens/s, speedup and its latency-model
                 prediction per task and overall, drafter-side KV bytes, paired bootstrap CIs between drafters
  *.png          tau per task, acceptance by draft index, speedup per task, tau vs position in the block

`--repeats N` times every call N times (the first run gives the outputs; the other N - 1 only time it again, all the
calls of a prompt in alternating order, reversed every other round) and reports the median prefill and the median
decode time (each run's wall time minus its own prefill), so that a speedup of a few percent per task is not one
noisy timing.

Greedy runs (`--temperature 0`, the default) check that every drafter's output equals plain decoding on every
prompt and turn; a mismatch stops the run with exit status 1 and names the prompt. At temperature 1 the fraction of
identical outputs is reported.

`--target` takes what `eval.generate` takes (smollm2, an HF directory, a .gguf file, an Orbax target) or
`random:<recipe>` (e.g. random:tiny): a randomly initialised target of `configs/<recipe>.py`, with weights scaled
up so greedy choices are far from ties, whose prompts are the SmolLM2 tokenizer's ids taken modulo its vocabulary
(`hspec_jax.chat`). It exercises the whole pipeline in seconds; its numbers say nothing about real drafters.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from eval.memory import kv_bytes_per_token
from eval.report import PLAIN, write_report
from hspec_jax.checkpoints import CheckpointError
from hspec_jax.cli import (
    AUTO,
    DEFAULT_COMPILE_CACHE,
    MAX_K,
    ArgumentParser,
    check_output_dir,
    parse_ks,
    portable,
    positive_int,
    run,
    use_compile_cache,
)
from hspec_jax.decoding import Bundle, SamplingConfig, bucketed_shapes, pad_batch
from hspec_jax.decoding.engine import compile_autoregressive, compile_speculative, generate_streaming
from hspec_jax.decoding.placement import Placement
from hspec_jax.decoding.policy import AdaptivePolicy, drafting
from hspec_jax.drafter_spec import drafter_config, load_drafter
from hspec_jax.machine import machine_facts
from hspec_jax.models import check_capacity
from hspec_jax.models.layers import for_backend
from hspec_jax.prompts import Prompt, load_prompts, parse_tasks
from hspec_jax.target_spec import Target, load_target_spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m eval.main", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--target", default="smollm2", help="smollm2, an HF dir, a .gguf, an Orbax dir, random:<recipe>"
    )
    parser.add_argument("--drafter", action="append", default=[], help="checkpoint dir or random:<kind>; repeatable")
    parser.add_argument("--recipe", default=None, help="recipe for random:<kind> drafters (default: the target's)")
    parser.add_argument(
        "--k",
        type=parse_ks,
        default=None,
        help=f"drafted tokens per step, comma-separated (e.g. auto,2,7): every drafter runs at each, 1..{MAX_K} "
        "or auto (chosen per step up to the drafter's k, at most 3 on CPU; default: each drafter's own k)",
    )
    parser.add_argument("--tasks", default="all", help="all, or a comma-separated list such as math,code")
    parser.add_argument(
        "--num-prompts", type=positive_int, default=None, help="prompts per task, spread evenly (default all)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per turn (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (lossless check), or e.g. 1")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts of one task generated together")
    parser.add_argument("--seed", type=int, default=0, help="sampling, random weights and bootstrap seed")
    parser.add_argument("--cache-length", type=int, default=None, help="one fixed KV capacity (default: bucketed)")
    parser.add_argument("--prompt-width", type=int, default=None, help="one fixed padded width (default: bucketed)")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="timed calls per prompt, turn and method, the methods alternating (times: medians; default 1)",
    )
    parser.add_argument("--bootstrap-resamples", type=int, default=10000)
    parser.add_argument(
        "--compile-cache",
        default=DEFAULT_COMPILE_CACHE,
        help=f"persistent XLA compilation cache directory, '' for none (default {DEFAULT_COMPILE_CACHE})",
    )
    parser.add_argument("--out", required=True, help="output directory")
    return parser.parse_args(argv)


class Method(NamedTuple):
    name: str
    drafter: tuple | None  # (config, params, vocab); None for plain decoding
    lookahead: int  # cache rows a step needs beyond the committed ones (k + 1; 0 for plain decoding)
    policy: AdaptivePolicy | None = None  # k=auto: the adaptive draft length up to the (cut) drafter's k


def load_methods(
    target: Target,
    drafters: list[str],
    prompt_ids: list[list[int]],
    ks: tuple[int | str, ...] | None = None,
) -> list[Method]:
    """Plain decoding, then one method per drafter spec (a checkpoint directory or random:<kind>; a random drafter's
    vocabulary comes from `prompt_ids`) and per draft length in `ks` (named `SPEC k=K`; None: the drafter's own k,
    named `SPEC`; auto: `SPEC k=auto`, the adaptive policy up to the drafter's own k, cut to 3 on CPU:
    `policy.drafting`). A shorter k drafts a shorter block with the same weights: the H-Spec kinds,
    causal inside the block, propose the same first k tokens as with their full block; DFlash and DSpark,
    bidirectional, propose other (still verified) ones."""
    methods = [Method(PLAIN, None, 0)]
    for spec in drafters:
        config = drafter_config(spec, target.config, target.recipe)
        params, vocab = load_drafter(spec, config, target.params, prompt_ids)
        for k in ks or (None,):
            sized, policy = drafting(config, k)
            name = portable(spec) if k is None else f"{portable(spec)} k={k}"
            methods.append(Method(name, (sized, params, vocab), sized.num_drafts + 1, policy))
    return methods


def units_of(prompts: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """Prompts timed together: consecutive prompts of one task, `batch_size` at a time."""
    units = []
    for task in dict.fromkeys(p.task for p in prompts):
        same = [p for p in prompts if p.task == task]
        units += [same[i : i + batch_size] for i in range(0, len(same), batch_size)]
    return units


class LosslessError(RuntimeError):
    pass


def same_output(out: np.ndarray, reference: np.ndarray, greedy: bool, method: Method, prompt: Prompt, turn: int):
    """Whether a speculative output equals plain decoding's; under greedy decoding a difference is an error that
    names the prompt (the engine must be lossless)."""
    identical = bool(np.array_equal(out, reference))
    if greedy and not identical:
        n = min(len(out), len(reference))
        differ = np.flatnonzero(out[:n] != reference[:n])
        at = int(differ[0]) if len(differ) else n
        raise LosslessError(
            f"{method.name} changed the greedy output of prompt {prompt.id} ({prompt.task}), turn {turn + 1}, "
            f"from token {at} on: speculative decoding must equal plain decoding"
        )
    return identical


class Evaluation:
    """Runs every method on every unit, turn by turn, compiling each (method, shape) once."""

    def __init__(self, target: Target, methods: list[Method], args: argparse.Namespace, results_file):
        self.target, self.methods, self.args, self.results = target, methods, args, results_file
        # Each compilation places the params as the backend runs them (`for_backend`: new fused arrays on CPU);
        # placing them once here lets every compiled (method, shape) share one copy of the weights.
        self.target_params = Placement(None, target.config).params(target.params)
        self.drafter_params: dict[int, dict] = {}
        for method in methods:
            if method.drafter is not None and id(method.drafter[1]) not in self.drafter_params:
                self.drafter_params[id(method.drafter[1])] = for_backend(method.drafter[1])
        self.sampling = SamplingConfig(temperature=args.temperature)
        self.lookahead = max(m.lookahead for m in methods)
        self.runners: dict[tuple, object] = {}
        self.kv_peak = dict.fromkeys((m.name for m in methods), 0)  # largest batch x capacity per method
        self.calls = 0

    def shapes(self, ids: list[list[int]]) -> tuple[int, int]:
        """(width, capacity) of a batch: bucketed, or the fixed ones given on the command line."""
        longest = max(len(x) for x in ids)
        width, capacity = bucketed_shapes(
            longest, longest, self.lookahead, self.args.max_new_tokens, self.args.cache_length
        )
        width = self.args.prompt_width or width
        if not longest <= width <= capacity:
            raise ValueError(f"a prompt of {longest} tokens padded to {width} does not fit in a cache of {capacity}")
        # The whole answer must fit, or plain and speculative decoding would stop at different cache ends.
        check_capacity(np.array([longest]), self.args.max_new_tokens + self.lookahead, capacity)
        return width, capacity

    def runner(self, method: Method, tokens: np.ndarray, lengths: np.ndarray, capacity: int, progress):
        key = (method.name, *tokens.shape, capacity)
        if key not in self.runners:
            progress.set_postfix_str(
                f"compiling {method.name} batch {tokens.shape[0]} width {tokens.shape[1]} capacity {capacity}"
            )
            t = self.target
            kw = dict(
                max_new_tokens=self.args.max_new_tokens,
                sampling=self.sampling,
                eos_ids=t.eos_ids,
                pad_id=t.pad_id,
                seed=self.args.seed,
            )
            if method.drafter is None:
                self.runners[key] = compile_autoregressive(
                    self.target_params, t.config, tokens, lengths, capacity, **kw
                )
            else:
                config, params, vocab = method.drafter
                bundle = Bundle(self.target_params, t.config, self.drafter_params[id(params)], config, vocab)
                self.runners[key] = compile_speculative(bundle, tokens, lengths, capacity, **kw, policy=method.policy)
            progress.set_postfix_str("")
        self.kv_peak[method.name] = max(self.kv_peak[method.name], tokens.shape[0] * capacity)
        return self.runners[key]

    def run(self, units: list[list[Prompt]]) -> list[dict]:
        rows = []
        total = sum(len(u[0].turns) for u in units) * len(self.methods)
        with tqdm(total=total, desc="eval", unit="turn", file=sys.stderr) as progress:
            for unit_index, unit in enumerate(units):
                plain_out: dict[tuple[str, int], np.ndarray] = {}
                calls = []  # (timed call, its rows) in order
                for method in self.methods:
                    answers: list[list[str]] = [[] for _ in unit]
                    for turn in range(len(unit[0].turns)):
                        progress.set_description(f"{unit[0].task} {method.name}")
                        outputs, new_rows, call = self.generate(method, unit, unit_index, turn, answers, progress)
                        for prompt, out, row in zip(unit, outputs, new_rows, strict=True):
                            if method.drafter is None:
                                plain_out[(prompt.id, turn)] = out
                            else:
                                reference = plain_out[(prompt.id, turn)]
                                row["identical"] = same_output(
                                    out, reference, self.sampling.greedy, method, prompt, turn
                                )
                        calls.append((call, new_rows))
                        progress.update(1)
                self.retime(calls)
                for _, new_rows in calls:
                    for row in new_rows:
                        self.results.write(json.dumps(row) + "\n")
                        rows.append(row)
                self.results.flush()
        return rows

    def retime(self, calls: list[tuple]) -> None:
        """`--repeats`: time every call of a unit again, `repeats - 1` more times, in alternating order (reversed
        every other round). Each row gets the median prefill time and the median of each run's own decode time
        (its wall time minus its prefill), summed into `call_seconds`. A long prompt's prefill takes about as long as
        its decode (a retrieval prompt of 660 tokens: 1.8-2.0 s beside 1.6 s of 64 tokens); the median wall time
        minus the median prefill, two medians of different runs, would hand the prefill's noise to the decode time
        the speedup is computed from. `call_seconds_runs` / `call_prefill_seconds_runs`: every run's wall and
        prefill times."""
        if self.args.repeats == 1:
            return
        times = [[(rows[0]["call_prefill_seconds"], rows[0]["call_seconds"])] for _, rows in calls]
        for r in range(1, self.args.repeats):
            order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
            for i in order:
                run, tokens, lengths, seed = calls[i][0]
                result = generate_streaming(run, self.args.max_new_tokens, prompts=(tokens, lengths), seed=seed)
                times[i].append((result.prefill_seconds, result.seconds))
        for (_, rows), timed in zip(calls, times, strict=True):
            prefill, wall = np.array(timed).T
            median_prefill, median_decode = float(np.median(prefill)), float(np.median(wall - prefill))
            for row in rows:
                row["call_prefill_seconds"] = median_prefill
                row["call_seconds"] = median_prefill + median_decode
                row["call_seconds_runs"] = [round(float(t), 6) for t in wall]
                row["call_prefill_seconds_runs"] = [round(float(t), 6) for t in prefill]

    def generate(self, method, unit, unit_index, turn, answers, progress):
        """One timed generation of turn `turn` for a unit -> (per prompt output ids, per prompt rows, the call:
        (compiled runner, tokens, lengths, seed), to time it again)."""
        ids = [self.target.encoder.encode(p, a) for p, a in zip(unit, answers, strict=True)]
        width, capacity = self.shapes(ids)
        tokens, lengths = pad_batch(ids, self.target.pad_id, width)
        run = self.runner(method, tokens, lengths, capacity, progress)
        seed = self.args.seed * 1_000_003 + unit_index * 16 + turn
        result = generate_streaming(run, self.args.max_new_tokens, prompts=(tokens, lengths), seed=seed)
        self.calls += 1
        if method.drafter is None:
            call_steps = max(int(result.num_tokens.max()) - 1, 0)
        else:
            call_steps = int(np.max(result.stats.steps))
        outputs, rows = [], []
        for b, prompt in enumerate(unit):
            n = int(result.num_tokens[b])
            out = result.tokens[b, :n]
            outputs.append(out)
            answers[b].append(self.target.encoder.decode(out))
            row = {
                "task": prompt.task,
                "prompt_id": prompt.id,
                "turn": turn + 1,
                "method": method.name,
                "unit": unit_index,
                "call": self.calls,
                "batch_size": len(unit),
                "prompt_tokens": len(ids[b]),
                "tokens": n,
                "call_seconds": result.seconds,
                "call_prefill_seconds": result.prefill_seconds,
                "call_steps": call_steps,
            }
            if method.drafter is not None:
                stats = result.stats
                row["steps"] = int(stats.steps[b])
                row["accepted"] = int(stats.accepted[b])
                row["reached_at"] = np.asarray(stats.reached_at[b]).tolist()
                row["accepted_at"] = np.asarray(stats.accepted_at[b]).tolist()
                row["predicted_at"] = np.asarray(stats.predicted_at[b]).round(4).tolist()
                row["k_steps"] = steps_by_draft_length(method, np.asarray(stats.chosen[b]))
                row["drafted"] = int(stats.drafted[b])
            rows.append(row)
        return outputs, rows, (run, tokens, lengths, seed)


def steps_by_draft_length(method: Method, chosen: np.ndarray) -> list[int]:
    """A row's steps per draft length `[k + 1]` (index = drafts verified; 0 = plain steps) from its counts per
    choice of the method's policy (fixed k: one choice)."""
    config = method.drafter[0]
    choices = method.policy.choices if method.policy else (config.num_drafts,)
    counts = np.zeros(config.num_drafts + 1, np.int64)
    counts[list(choices)] = chosen
    return counts.tolist()


def method_meta(method: Method, target_config, kv_peak_rows: int) -> dict:
    """Name, kind, k and drafter-side KV bytes (per token by `eval.memory`'s formula, and the run's peak)."""
    if method.drafter is None:
        return {"name": method.name, "kind": "plain", "k": 0, "kv_bytes_per_token": 0, "kv_bytes_peak": 0}
    config = method.drafter[0]
    itemsize = jnp.dtype(config.compute_dtype).itemsize
    per_token = kv_bytes_per_token(config.cache_layers, target_config.num_kv_heads, target_config.head_dim, itemsize)
    return {
        "name": method.name,
        "kind": config.kind,
        "k": AUTO if method.policy else config.num_drafts,
        "k_max": config.num_drafts,
        "confidence_head": config.confidence_head,
        "kv_bytes_per_token": per_token,
        "kv_bytes_peak": per_token * kv_peak_rows,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        check_output_dir(args.out)
        if args.temperature not in (0.0, 1.0):
            raise ValueError("--temperature must be 0 (greedy) or 1")
        if args.batch_size < 1 or args.max_new_tokens < 1:
            raise ValueError("--batch-size and --max-new-tokens must be >= 1")
        if len(set(args.drafter)) != len(args.drafter):
            raise ValueError("each --drafter may be given once")
        if args.k and not args.drafter:
            raise ValueError("--k sets the drafted tokens per step: it needs --drafter")
        prompts = load_prompts(parse_tasks(args.tasks), args.num_prompts)
        target = load_target_spec(args.target, args.recipe, args.seed)
        first_turns = [target.encoder.encode(p, []) for p in prompts]
        methods = load_methods(target, args.drafter, first_turns, args.k)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    use_compile_cache(args.compile_cache)
    units = units_of(prompts, args.batch_size)
    with open(os.path.join(args.out, "results.jsonl"), "w") as results:
        evaluation = Evaluation(target, methods, args, results)
        try:
            rows = evaluation.run(units)
        except (LosslessError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    meta = {
        "command": portable("python -m eval.main " + shlex.join(argv)),
        "target": target.name,
        "machine": machine_facts(target.config.dtype),
        "settings": {
            "tasks": ",".join(dict.fromkeys(p.task for p in prompts)),
            "prompts": len(prompts),
            "max new tokens per turn": args.max_new_tokens,
            "temperature": args.temperature,
            "batch size": args.batch_size,
            "seed": args.seed,
            "timed calls per turn (median)": args.repeats,
            "compiled shapes": len(evaluation.runners),
        },
        "methods": [method_meta(m, target.config, evaluation.kv_peak[m.name]) for m in methods],
        "bootstrap_resamples": args.bootstrap_resamples,
        "seed": args.seed,
    }
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for path in write_report(args.out, rows, meta):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))

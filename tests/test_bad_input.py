"""Every bad input to the command-line tools gets one line on stderr and a non-zero exit, before any weights
are loaded where the input allows; files are named; nothing is half-written; Ctrl-C keeps what was generated.

The tools run on a tiny random Llama saved as an HF directory with a word-level tokenizer (no model download,
loads in milliseconds), so argument and file checks cost nothing and decoding is fast.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from eval import generate, memory, params
from hspec_jax import cli
from hspec_jax.checkpoints import convert, load_target
from hspec_jax.checkpoints.hf import CheckpointError, export_hf_target, remove_stale_staging, staged_directory
from hspec_jax.checkpoints.orbax_io import save_target
from hspec_jax.models import TargetConfig, init_params
from hspec_jax.recipes import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 256
CONTEXT = 50_000
EOS = VOCAB - 1
TINY = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": CONTEXT,
    "tie_word_embeddings": False,
    "eos_token_id": EOS,
    "pad_token_id": 0,
}


def word_tokenizer():
    """A word-level tokenizer over "w0".."w254" plus <eos> (also unknown and padding), plain chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<eos>": EOS}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<eos>", eos_token="<eos>", pad_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """An HF directory (config.json, model.safetensors, tokenizer) whose greedy output never reaches EOS."""
    config = TargetConfig.from_hf(TINY)
    weights = init_params(config, jax.random.key(0))
    weights["lm_head"] = weights["lm_head"].at[EOS].set(0.0)  # EOS logit 0, below the greedy maximum
    path = str(tmp_path_factory.mktemp("tiny") / "hf")
    export_hf_target(weights, config, path, tokenizer=word_tokenizer())
    return path


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def run_tool(main, argv, capsys) -> tuple[int, str]:
    """(exit status, the single stderr line) of a tool run in-process through the shared handler."""
    try:
        status = cli.run(main, argv)
    except SystemExit as e:  # argparse
        status = e.code
    assert status != 0
    return status, one_error_line(capsys)


GENERATE_ARGS = [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["--max-new-tokens", "-1"], "--max-new-tokens: must be at least 1"),
    (["--max-new-tokens", "0", "--drafter", "random:hspec"], "--max-new-tokens: must be at least 1"),
    (["--temperature", "-1"], "--temperature: must be 0 or more"),
    (["--temperature", "nan"], "--temperature: expected a finite number"),
    (["--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    (["--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["--top-k", "-5"], "--top-k: must be 0 or more"),
    (["--cache-length", "x"], "--cache-length: expected an integer"),
    (["--k", "3"], "--k sets the drafted tokens per step: it needs --drafter"),
    (["--drafter", "random:hspec", "--k", "16"], "--k must be in 1..15"),
    (["--drafter", "random:eagle"], "unknown drafter kind 'eagle'"),
    (["--drafter", "/nonexistent/drafter"], "neither random:<kind>, a shipped drafter"),
    (["--drafter", "random:hspec", "--recipe", "configs/nope.py"], "recipe file 'configs/nope.py' does not exist"),
    (["--drafter", "random:hspec", "--recipe", "README.md"], "README.md' is not a recipe file"),
    (["--recipe", "configs/smollm2.py"], "--recipe builds random:<kind> drafters"),
    (["--mesh", "data=64"], "--mesh: mesh 'data=64' needs 64 devices"),
    (["--no-chat", "--prompt", ""], "--prompt must not be empty"),
    (["--target", "/nonexistent/model"], "neither an embedded model"),
]


@pytest.mark.parametrize(("args", "message"), GENERATE_ARGS)
def test_generate_refuses_bad_arguments_before_loading(args, message, capsys):
    """No model is given that could be loaded in time: every one of these is refused from the arguments alone."""
    start = time.perf_counter()
    _, line = run_tool(generate.main, ["--prompt", "hi", *args], capsys)
    assert message in line
    assert time.perf_counter() - start < 5, "checked after loading something heavy"


def test_generate_checks_the_request_against_the_model(tiny_dir, capsys):
    """Context, cache length, memory and the tokenizer are checked from config and tokenizer, before weights."""
    os.rename(os.path.join(tiny_dir, "model.safetensors"), os.path.join(tiny_dir, "weights.away"))
    try:
        cases = [
            (["--max-new-tokens", str(CONTEXT)], f"more than the model's context of {CONTEXT}"),
            (["--max-new-tokens", "1000000"], "more than the model's context"),
            (["--cache-length", "40", "--max-new-tokens", "32"], "use a cache length of at least"),
            (["--cache-length", str(10**13)], "GiB of available host memory is left"),
        ]
        for args, message in cases:
            _, line = run_tool(
                generate.main, ["--target", tiny_dir, "--prompt", "w1 w2 w3 w4 w5 w6 w7 w8 w9", *args], capsys
            )
            assert message in line
    finally:
        os.rename(os.path.join(tiny_dir, "weights.away"), os.path.join(tiny_dir, "model.safetensors"))


def test_generate_streams_and_reports_prefill_and_decode_speed(tiny_dir, capsys):
    assert cli.run(generate.main, ["--target", tiny_dir, "--prompt", "w5 w6 w7", "--max-new-tokens", "20"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out[0].split()) == 20 and all(w.startswith("w") for w in out[0].split())
    assert out[1].startswith("prefill: 3 tokens in ") and out[1].endswith("tok/s)")
    assert out[2].startswith("decode: 19 tokens in ")
    assert out[3].startswith("timed: median of 1 warm run(s) after the printed one")


def test_acceptance_rates_show_unreached_positions_as_a_dash():
    assert generate.format_rates([0.5, 0.25, float("nan")]) == "0.50,0.25,-"


def write_drafter_dir(path, manifest: str | None = '{"format": "hspec-jax-drafter", "config": {}}'):
    os.makedirs(path)
    open(os.path.join(path, "model.safetensors"), "w").close()
    with open(os.path.join(path, "hspec_drafter.json"), "w") as f:
        f.write(manifest)
    return str(path)


def test_drafter_checkpoint_problems_are_named(tmp_path, capsys):
    no_vocab = write_drafter_dir(tmp_path / "no_vocab")
    _, line = run_tool(generate.main, ["--prompt", "hi", "--drafter", no_vocab], capsys)
    assert line == f"error: drafter checkpoint {no_vocab!r} has no vocab.npz"
    truncated = write_drafter_dir(tmp_path / "truncated", '{"format": "hspec-jax-drafter", "con')
    _, line = run_tool(generate.main, ["--prompt", "hi", "--drafter", truncated], capsys)
    assert line.startswith(f"error: {os.path.join(truncated, 'hspec_drafter.json')}: not valid JSON")


def corrupt(path, how):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2] if how == "truncated" else b"\x00" * len(data))


@pytest.mark.parametrize("how", ["truncated", "zeroed"])
def test_corrupted_safetensors_is_named(tiny_dir, tmp_path, how, capsys):
    broken = shutil.copytree(tiny_dir, tmp_path / "broken")
    corrupt(broken / "model.safetensors", how)
    _, line = run_tool(convert.main, ["--from", str(broken), "--to", str(tmp_path / "out")], capsys)
    assert line.startswith(f"error: {broken / 'model.safetensors'}: not a readable safetensors file")
    assert not (tmp_path / "out").exists()


def test_truncated_config_json_is_named(tiny_dir, tmp_path, capsys):
    broken = shutil.copytree(tiny_dir, tmp_path / "broken")
    corrupt(broken / "config.json", "truncated")
    _, line = run_tool(convert.main, ["--from", str(broken), "--to", str(tmp_path / "out")], capsys)
    assert line.startswith(f"error: {broken / 'config.json'}: not valid JSON")


def test_bad_config_values_are_named(tiny_dir, tmp_path, capsys):
    broken = shutil.copytree(tiny_dir, tmp_path / "broken")
    (broken / "config.json").write_text(json.dumps({**TINY, "num_attention_heads": 0}))
    _, line = run_tool(convert.main, ["--from", str(broken), "--to", str(tmp_path / "out")], capsys)
    assert (
        line == f"error: {broken / 'config.json'}: config value 'num_attention_heads' must be a positive integer, got 0"
    )


def test_truncated_gguf_is_named(tmp_path, capsys):
    from hspec_jax.checkpoints import resolve

    with open(resolve("smollm2"), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(100_000))
    _, line = run_tool(convert.main, ["--from", str(tmp_path / "cut.gguf"), "--to", str(tmp_path / "out")], capsys)
    assert line.startswith(f"error: {tmp_path / 'cut.gguf'}: not a readable GGUF file")


def test_non_finite_weights_are_refused(tiny_dir, tmp_path, capsys):
    config, weights = load_target(tiny_dir)
    weights["layers"]["mlp"]["up_proj"]["kernel"] = (
        weights["layers"]["mlp"]["up_proj"]["kernel"].at[1, 3, 4].set(np.nan)
    )
    export_hf_target(weights, config, str(tmp_path / "hf"))
    _, line = run_tool(convert.main, ["--from", str(tmp_path / "hf"), "--to", str(tmp_path / "out")], capsys)
    bad = "['layers']['mlp']['up_proj']['kernel']"
    assert line == f"error: {tmp_path / 'hf'}: parameter {bad} holds NaN or Inf values (1 such array(s))"
    weights["norm"]["scale"] = weights["norm"]["scale"].at[0].set(np.inf)
    save_target(str(tmp_path / "orbax"), weights, config)
    with pytest.raises(CheckpointError, match=r"holds NaN or Inf values \(2 such"):
        load_target(str(tmp_path / "orbax"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "floaty"], "--dtype: unknown dtype 'floaty'; choose from float32, bfloat16, float16"),
        (["--dtype", "int8"], "--dtype: unknown dtype 'int8'"),
        (["--format", "gguf"], "--format: invalid choice"),
    ],
)
def test_convert_refuses_bad_arguments(args, message, tmp_path, capsys):
    _, line = run_tool(convert.main, ["--from", "smollm2", "--to", str(tmp_path / "out"), *args], capsys)
    assert message in line


def test_params_and_memory_refuse_bad_input(tmp_path, capsys):
    assert (
        "README.md' is not a recipe file"
        in run_tool(params.main, ["--config", os.path.join(ROOT, "README.md")], capsys)[1]
    )
    assert "unknown recipe 'nope'" in run_tool(params.main, ["--config", "nope"], capsys)[1]
    zero_heads = tmp_path / "config.json"
    zero_heads.write_text(json.dumps({**TINY, "num_attention_heads": 0}))
    line = run_tool(memory.main, ["--target", str(zero_heads)], capsys)[1]
    assert line == f"error: {zero_heads}: config value 'num_attention_heads' must be a positive integer, got 0"
    assert "--dtype: unknown dtype 'floaty'" in run_tool(memory.main, ["--dtype", "floaty"], capsys)[1]
    assert "--dflash-layers: must be at least 1, got -3" in run_tool(memory.main, ["--dflash-layers", "-3"], capsys)[1]
    zero_heads.write_text('{"num_attention_heads": ')
    assert f"error: {zero_heads}: not valid JSON" in run_tool(memory.main, ["--target", str(zero_heads)], capsys)[1]


def test_recipes_load_by_name_or_path():
    assert load_config("smollm2").target.name == load_config(os.path.join(ROOT, "configs", "smollm2.py")).target.name


# --- writing checkpoints: destination checks, full disk, killed runs ---


def in_small_filesystem(mount: str, options: str, command: list[str]) -> subprocess.CompletedProcess:
    """Run `command` with a fresh tmpfs (mount `options`) at `mount`, in a user + mount namespace (no root)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip("user namespaces are not available here")
    script = f'mount -t tmpfs -o {options} tmpfs "{mount}" && exec "$@"'
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", *command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def test_read_only_destination_is_refused_before_loading(tiny_dir, tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    proc = in_small_filesystem(
        str(mount),
        "ro,size=1m",
        [sys.executable, "-m", "hspec_jax.checkpoints.convert", "--from", tiny_dir, "--to", f"{mount}/out"],
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == f"error: cannot write to '{mount}': Read-only file system\n"


def test_full_disk_is_refused_before_loading(tiny_dir, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    for fmt in ("orbax", "hf"):
        command = ["-m", "hspec_jax.checkpoints.convert", "--from", tiny_dir, "--to", f"{mount}/out", "--format", fmt]
        proc = in_small_filesystem(str(mount), "size=64k", [sys.executable, *command])
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.startswith(f"error: no space left on {mount}: the checkpoint needs about 0.1 MiB, ")
        assert len(proc.stderr.splitlines()) == 1 and os.listdir(mount) == []


def test_disk_full_while_writing_is_one_line_and_leaves_nothing(tmp_path):
    with (
        pytest.raises(CheckpointError, match=f"^no space left on {tmp_path}$"),
        staged_directory(str(tmp_path / "out")),
        open("/dev/full", "w") as f,
    ):  # a real ENOSPC
        f.write("x")
    assert os.listdir(tmp_path) == []


def test_staging_left_by_a_killed_run_is_removed_by_the_next(tmp_path):
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from hspec_jax.checkpoints.hf import staged_directory\n"
            "with staged_directory(sys.argv[1]) as staging:\n"
            "    open(staging + '/part', 'w').write('x' * 1000); print(staging, flush=True); time.sleep(600)",
            str(tmp_path / "out"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    staging = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert os.path.basename(staging).startswith(f".staging-{child.pid}@{socket.gethostname()}-")
    mine = tmp_path / f".staging-{os.getpid()}@{socket.gethostname()}-alive"
    mine.mkdir()
    with staged_directory(str(tmp_path / "other")) as new:
        open(os.path.join(new, "x"), "w").close()
    assert not os.path.exists(staging) and mine.exists() and (tmp_path / "other" / "x").exists()
    assert remove_stale_staging(str(tmp_path)) == []


# --- Ctrl-C ---


def start_generate(tiny_dir, *args):
    """`eval.generate` on the tiny target."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen(
        [sys.executable, "-m", "eval.generate", "--target", tiny_dir, "--prompt", "w1 w2", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )


def test_ctrl_c_while_decoding_keeps_the_text_and_exits_130(tiny_dir):
    proc = start_generate(tiny_dir, "--max-new-tokens", str(CONTEXT - 10), "--chunk", "4")
    first = proc.stdout.read1(4096)  # the first streamed words: decoding has started
    assert first.startswith(b"w"), first
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    words = (first + rest).decode().split()
    assert 0 < len(words) < CONTEXT - 10 and all(w.startswith("w") for w in words)
    assert err.decode().splitlines()[-1] == f"interrupted after {len(words)} tokens"
    assert b"Traceback" not in err


WAIT_FOREVER = """
import os, signal, sys, threading
from eval.generate import Interrupt
with Interrupt() as interrupt:
    print("waiting", flush=True)
    if sys.argv[1] == "before":
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C just before the wait starts: only a flag so far
    interrupt.wait_for(threading.Event().wait)  # stands for loading or compiling, which never ends here
print("returned", flush=True)
"""


@pytest.mark.parametrize("when", ["during", "before"])
def test_ctrl_c_while_loading_or_compiling_exits_130_at_once(when):
    # `eval.generate` loads and compiles inside `Interrupt.wait_for`; a blocked wait makes the timing certain
    # (a real compile of the tiny target can end before the signal arrives).
    proc = subprocess.Popen(
        [sys.executable, "-c", WAIT_FOREVER, when],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.stdout.readline() == b"waiting\n"
    if when == "during":
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and out == b""
    assert err.decode().strip().splitlines()[-1] == "interrupted" and b"Traceback" not in err

"""Shared fixtures: tiny random HF checkpoints (Llama with llama3 RoPE scaling, Qwen3, Qwen2), the
embedded SmolLM2 target (loaded once per session, in JAX and in transformers), and `train.main` runs forked from a
warm interpreter."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tests compile hundreds of small programs and run few of them long (compilation is ~85% of tests/test_adaptive.py).
# XLA's CPU backend at LLVM -O0 compiles about 30% faster (tests/test_speculative.py on tiny targets: 21.6 s of
# compilation -> 14.0 s) and the SmolLM2 tests run no slower; one LLVM module per program instead of parallel
# codegen splits, and the older loop fusion emitters, take another ~30% off (test_auto_drafts_far_with_a_good_drafter:
# 16.5-17.6 s of backend compilation -> 11.0-12.9 s, three interleaved runs each). Every program in a run (and the
# command lines it starts) is compiled the same way, so lossless and exact-resume comparisons still compare like
# with like. Flags set by the caller are kept.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_parallel_codegen_split_count=1 --xla_cpu_use_fusion_emitters=false",
)

import jax
import numpy as np
import pytest
import torch
from forked_main import TrainMain

from hspec_jax.checkpoints import load_target, load_tokenizer, resolve

TINY_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_hf_config(family: str, **overrides):
    """A tiny random-init transformers config of the given family."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(**{**TINY_COMMON, "rope_parameters": LLAMA3_ROPE, **overrides})
    if family == "llama_tied":
        return LlamaConfig(**{**TINY_COMMON, "tie_word_embeddings": True, **overrides})
    if family == "qwen3":
        return Qwen3Config(
            **{**TINY_COMMON, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **overrides}
        )
    if family == "qwen2":
        return Qwen2Config(**{**TINY_COMMON, **overrides})
    raise ValueError(family)


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    """A transformers CausalLM with every weight randomised (norm scales around 1), in fp32 eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(params=["llama", "llama_tied", "qwen3", "qwen2"])
def tiny_hf_dir(request, tmp_path):
    """(family, transformers model, saved HF directory) for each supported family."""
    model = tiny_hf_model(request.param)
    path = tmp_path / request.param
    model.save_pretrained(path)
    return request.param, model, str(path)


COMPILE_CACHE = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
    """One persistent XLA compilation cache for the whole run, in a fresh directory: the test processes
    (pytest-xdist workers inherit it from the controller) and the command lines they start load a program
    compiled once instead of compiling it again (after `free_compiled_programs`, in another worker, or in a
    subprocess). Multi-process jobs must not use it (see `tests/test_train_main.py`). A directory set in the
    environment by the caller is used as is and kept.

    And always one fresh user cache (`hspec_jax.user_cache`: measured step costs, the tokenizer converted from
    SmolLM2's GGUF file): built once in the run and shared by its processes, never read from or left in the
    caller's cache directory."""
    if not hasattr(config, "workerinput"):
        config.hspec_owned_dirs = [tempfile.mkdtemp(prefix="hspec-test-cache-")]
        os.environ["XDG_CACHE_HOME"] = config.hspec_owned_dirs[0]
        if COMPILE_CACHE not in os.environ:
            config.hspec_owned_dirs.append(tempfile.mkdtemp(prefix="hspec-test-xla-"))
            os.environ[COMPILE_CACHE] = config.hspec_owned_dirs[-1]
            # Every program, however quick to compile: a warm `train.main` run on `tiny` takes 18 s instead of 26.
            os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    jax.config.update("jax_compilation_cache_dir", os.environ[COMPILE_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def without_compile_cache(env: dict) -> dict:
    """`env` minus the run's compilation cache, for a command line that must compile for itself."""
    return {k: v for k, v in env.items() if k != COMPILE_CACHE}


# The longest test groups (seconds of test time in one whole run, AMD EPYC, two workers: test_speculative 97,
# test_adaptive 90, test_http_server 80, test_drafters 75, test_train_step 59, test_serving 58, test_smollm2 53; the
# other 36 groups 1-48 s each), the multi-process group (160 s) last of them: its tests start processes that use
# both cores, and run beside the heaviest files they slow down most (its two-process training test: 41 s in
# pytest-xdist's order, 66-72 s in these two).
HEAVY_FIRST = (
    "test_speculative.py",
    "test_adaptive.py",
    "test_http_server.py",
    "test_drafters.py",
    "test_train_step.py",
    "test_serving.py",
    "test_smollm2.py",
    "processes",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist's `--dist loadgroup` (`make test`) a worker takes whole test files, so module fixtures
    are built once; the tests marked `xdist_group("processes")` (many simulated devices or several
    processes, each using every core) run one after another on one worker, never two at once. Groups are handed
    out in the order of the items (with `--no-loadscope-reorder`; by default pytest-xdist orders them by their
    number of tests): the longest (`HEAVY_FIRST`) go first and the short ones fill in at the end, so that the two
    workers finish together. On clean clones, alone on 2 AMD EPYC cores (one run each): 548.6 s of pytest in this
    order, 562.0 s with the multi-process group first (564.2 s in pytest-xdist's order, measured before
    tests/test_mamba2.py and the random inits took ~10 s less)."""
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(os.path.basename(item.fspath)))

    def rank(item):
        group = item.get_closest_marker("xdist_group").args[0]
        return HEAVY_FIRST.index(group) if group in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=rank)


def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist groups a worker's tests by the `@group` it appends to their ids; where it cannot (pytest 9.2
    with xdist 3.8), every group is scattered over the workers: module fixtures are built once per worker and the
    multi-process tests run side by side. Stop at once instead of running the suite that way."""
    if node.config.getoption("dist") == "loadgroup" and any("@" not in nodeid for nodeid in ids):
        reason = "pytest-xdist did not group the tests (--dist loadgroup): use the pytest pinned in pyproject.toml"
        pytest.exit(reason, returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_unconfigure(config):
    for owned in getattr(config, "hspec_owned_dirs", ()):
        shutil.rmtree(owned, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def free_compiled_programs():
    """Drop every compiled program after each test module. Each XLA CPU executable keeps a few memory maps and
    one pytest process compiles thousands; without this the map count climbs toward the kernel's limit
    (vm.max_map_count, 65530) and the whole suite died in an XLA compilation (a segfault in
    tests/test_speculators.py, which passes alone)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def train_driver(tmp_path_factory):
    """Runs `python -m train.main` command lines as forked children of a warm interpreter (tests/forked_main.py)."""
    driver = TrainMain(dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu"), str(tmp_path_factory.mktemp("runs")))
    yield driver
    driver.close()


@pytest.fixture(scope="session")
def smollm2():
    """(config, params) of the embedded SmolLM2-135M-Instruct, in fp32."""
    return load_target("smollm2")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def smollm2_hf():
    """The same GGUF loaded by transformers (the independent reference), fp32."""
    from transformers import AutoModelForCausalLM

    path = resolve("smollm2")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


CHAT_PROMPT = "Write a short poem about the sea, then explain its meaning."


@pytest.fixture(scope="session")
def chat_prompt(smollm2_tokenizer):
    from hspec_jax.chat import chat_prompt_ids

    return chat_prompt_ids(smollm2_tokenizer, CHAT_PROMPT)


def hf_logits(model, ids, **kwargs):
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(ids)), **kwargs)
    return out


def jax_allclose(a, b, atol):
    np.testing.assert_allclose(np.asarray(jax.device_get(a)), np.asarray(b), atol=atol, rtol=0)

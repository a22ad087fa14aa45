"""eval.params and eval.memory: the paper's parameter matching and KV-inflation numbers from config values;
eval.startup's probe."""

import json
import os
import subprocess
import sys

from eval import memory, params, startup
from hspec_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_params_table_matches_the_papers_parameter_budget(capsys):
    assert params.main(["--config", "configs/qwen3_8b.py"]) == 0
    out = capsys.readouterr().out
    assert "| **trainable total** | **1,063,552,449** | **1,095,718,401** | **1,048,626,432** |" in out
    assert "H-Spec vs DSpark: -2.94% trainable parameters" in out  # the paper: within 2.9%
    for config in ("configs/llama.py", "configs/qwen3_4b.py"):
        assert params.main(["--config", config]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("H-Spec vs DSpark"))
        assert abs(float(line.split(":")[1].split("%")[0])) < 2.95


def test_params_bad_config_path(capsys):
    assert cli.run(params.main, ["--config", "configs/nope.py"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_memory_reproduces_table_1(capsys):
    assert memory.main([]) == 0
    out = capsys.readouterr().out
    assert "| meta-llama/Llama-3.1-8B-Instruct | 32/32 | DFlash | 128.00 | 20.00 | 1.156x |" in out
    assert "| Qwen/Qwen3-4B | 36/36 | DFlash | 144.00 | 20.00 | 1.139x |" in out
    assert "| Qwen/Qwen3-8B | 36/36 | DSpark | 144.00 | 20.00 | 1.139x |" in out
    assert "| Qwen/Qwen3-8B | 36/36 | H-Spec (all variants) | 144.00 | 0.00 | 1.000x |" in out


def test_memory_counts_only_attention_layers(tmp_path, capsys):
    hybrid = {
        "model_type": "x",
        "text_config": {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "hidden_size": 1024,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        },
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hybrid))
    assert memory.main(["--target", str(path)]) == 0
    out = capsys.readouterr().out
    # 2 attention layers x 2 (K, V) x 2 heads x 128 x 2 bytes = 2 KiB; DFlash 5 layers = 5 KiB
    assert f"| {path} | 2/4 | DFlash | 2.00 | 5.00 | 3.500x |" in out


def test_memory_formula_matches_the_real_buffers():
    """The bytes per token the report prints are the bytes the caches we allocate actually hold."""
    import jax

    from hspec_jax.drafters import empty_context
    from hspec_jax.models import init_cache
    from hspec_jax.recipes import drafter_from_recipe, load_config, target_config

    recipe = load_config("configs/qwen3_8b.py")
    target = target_config(recipe, dtype="bfloat16")
    rows = memory.memory_rows(recipe.target.hf_config.to_dict(), 2, 5)
    cache = jax.eval_shape(lambda: init_cache(target, 2, 64))
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v))) == rows[0][1] * 2 * 64
    dflash = drafter_from_recipe(recipe, "dflash", target)
    context = jax.eval_shape(lambda: empty_context(dflash, 2, 64))
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(context)) == rows[2][2] * 2 * 64


def test_memory_bad_target(capsys):
    assert cli.run(memory.main, ["--target", "gpt5"]) == 1
    assert "neither a config.json file nor a recipe" in capsys.readouterr().err


def test_startup_probe_times_every_phase_of_one_generate_run(tmp_path, capsys, monkeypatch):
    """The probe wraps the functions of `eval.generate` it times (a renamed one fails here, not in a 10-minute
    benchmark) and prints the phases of one whole run (a tiny target alone: no drafter, no cost table)."""
    import jax
    from test_bad_input import TINY, word_tokenizer

    import eval.generate
    from hspec_jax.checkpoints.hf import export_hf_target
    from hspec_jax.decoding import engine
    from hspec_jax.models import TargetConfig, init_params

    config = TargetConfig.from_hf(TINY)
    export_hf_target(init_params(config, jax.random.key(0)), config, str(tmp_path), tokenizer=word_tokenizer())

    modules = {"generate": eval.generate, "engine": engine}
    for module, name, _ in startup.PHASES:  # restored after the test: the probe rebinds them
        monkeypatch.setattr(modules[module], name, getattr(modules[module], name))
    startup.probe(["--target", str(tmp_path), "--prompt", "w1 w2", "--max-new-tokens", "4", "--repeats", "0"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(startup.MARK))
    record = json.loads(line.removeprefix(startup.MARK))
    assert record["exit"] == 0
    phases = {"imports", "config and tokenizer", "target load", "engine build", "trace", "lower", "printed run"}
    assert phases <= set(record["phases"]) and all(v >= 0 for v in record["phases"].values())


def test_generate_starts_without_the_back_ends_it_does_not_use():
    """`eval.generate` (every command line's start-up) imports neither Orbax nor Pallas' GPU and TPU back ends
    (~0.9 s of imports together): a GGUF or HF target with a safetensors drafter reads no Orbax file and CPU runs the
    reference attention. Using them imports them."""
    heavy = ("orbax.checkpoint", "jax._src.pallas.triton", "jax._src.pallas.mosaic.lowering")
    check = (
        "import sys, eval.generate; print([m for m in HEAVY if m in sys.modules]);"
        "from hspec_jax.kernels.target_kv_attention import KernelSettings;"
        "from hspec_jax.checkpoints.orbax_io import orbax; orbax(); print([m for m in HEAVY if m not in sys.modules])"
    )
    code = f"HEAVY = {heavy!r}; {check}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.splitlines() == ["[]", "[]"]

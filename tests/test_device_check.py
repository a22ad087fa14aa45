"""The accelerator check's plumbing, on CPU with tiny shapes: the shell entry point, one process per section,
the report, and a failing section recorded in the report instead of stopping the run."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_check(out, *args, **env):
    cmd = ["bash", "benchmarks/device_check.sh", "--small", "--out", str(out), *args]
    env = {**os.environ, "PYTHON": sys.executable, **env}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out.read_text()


def test_small_run_writes_every_section(tmp_path):
    # smollm2 runs the same code as llama8b (another recipe): one of them covers it here.
    report = run_check(tmp_path / "device.md", "--sections", "environment,kernel,llama8b")
    assert report.startswith("# Device check: cpu")
    for section in ("## environment", "## kernel", "## llama8b"):
        assert section in report
    assert "jax==" in report
    assert "| tiny (6, 2, 16) | 40 | 2 |" in report
    assert "**Kernel matched the reference at every shape** on `cpu`" in report
    assert "### drafters with reference attention" in report and "| T_D(7) hspec |" in report
    assert "FAILED" not in report


def test_a_failing_section_is_recorded_and_the_run_goes_on(tmp_path):
    report = run_check(
        tmp_path / "device.md", "--sections", "environment,environment", JAX_PLATFORMS="no_such_platform"
    )
    assert report.count("**FAILED**") == 2  # both attempts recorded, with jax's own error text
    assert "no_such_platform" in report


def test_sections_past_the_budget_are_reported_as_not_run(tmp_path):
    report = run_check(tmp_path / "device.md", "--sections", "environment,kernel", "--budget", "1")
    assert report.count("**NOT RUN**") == 2

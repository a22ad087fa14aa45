"""`python -m train.main` command lines run by a warm interpreter: each is a forked child that runs the module as
`__main__` (`runpy`, as `python -m` does), so it costs a fork instead of a fresh interpreter importing JAX, Orbax
and Grain (3-4 s of CPU each). The driver imports what train.main imports but never the module itself (its flags
are defined once, by each child) and never starts a JAX backend, so every child starts its own, as a new process
would. A child is a real process: it can be killed (SIGKILL included) and its exit status is the command's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = """
import json, os, runpy, signal, sys
import absl.app, ml_collections.config_flags, hspec_jax.cli, train.loop
for line in sys.stdin:
    request = json.loads(line)
    if request[0] == "wait":
        print(os.waitstatus_to_exitcode(os.waitpid(request[1], 0)[1]), flush=True)
        continue
    _, args, out, err, timeout = request
    pid = os.fork()
    if pid == 0:
        signal.alarm(timeout)
        for path, fd in ((out, 1), (err, 2)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["train.main", *args]
        code = 0
        try:
            runpy.run_module("train.main", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
"""


class Child:
    """A started command line: its pid, its stdout and stderr files, and once waited for, its exit status."""

    def __init__(self, driver: TrainMain, pid: int, out: str, err: str):
        self.driver, self.pid, self.out, self.err = driver, pid, out, err
        self.status: int | None = None

    def wait(self) -> int:
        """The exit status (negative: killed by that signal), as `subprocess.Popen.wait` gives it."""
        self.status = self.driver.request(["wait", self.pid])
        return self.status

    def stdout(self) -> str:
        with open(self.out) as f:
            return f.read()

    def stderr(self) -> str:
        with open(self.err) as f:
            return f.read()


class TrainMain:
    """The driver process: `start(args)` forks one `train.main` run (its output in `logdir/<n>.out`, `.err`), `run`
    also waits for it."""

    def __init__(self, env: dict, logdir: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.logdir, self.started = logdir, 0

    def request(self, message: list) -> int:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def start(self, args: list, timeout: int = 900) -> Child:
        self.started += 1
        out, err = (os.path.join(self.logdir, f"{self.started}.{ext}") for ext in ("out", "err"))
        return Child(self, self.request(["start", [str(a) for a in args], out, err, timeout]), out, err)

    def run(self, args: list, timeout: int = 900) -> Child:
        child = self.start(args, timeout)
        child.wait()
        return child

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

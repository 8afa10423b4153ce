"""Run many ``elr`` commands, each in its own process, paying for the CLI's imports once.

``python -m elr_lightning.cli ARGS`` spends about 8 s of CPU time importing Lightning before it reads
its arguments (torchmetrics imports transformers where it is installed). A test that runs dozens of
commands as a user does runs :func:`run_commands`: one process imports ``elr_lightning.cli`` (what
``python -m elr_lightning.cli`` imports before ``main``) and forks a child per command, which changes
to the command's folder, takes its environment, and runs ``main`` with its arguments, its output
in files. The child is a fresh process for everything the command does: nothing of one command is
in another's, and nothing the command imports (a checkpoint's module, a plug-in) is in the parent.

``python _forked_cli.py SPEC.json OUT.json``: SPEC is ``{"jobs": [{"args", "cwd", "env"}], "parallel": N}``;
OUT gets one ``{"returncode", "stdout", "stderr"}`` per job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run_commands(jobs: list[dict], env: dict[str, str], parallel: int = 2, timeout: float = 1200) -> list:
    """Run each job (``args``: the ``elr`` arguments, ``cwd``, ``env``: variables over ``env``) in a forked process.

    ``env`` is the environment the parent process starts with (its ``PYTHONPATH`` decides what it imports
    from where); returns one :class:`subprocess.CompletedProcess` per job, in order.
    """
    with tempfile.TemporaryDirectory() as folder:
        spec, out = Path(folder) / "spec.json", Path(folder) / "out.json"
        spec.write_text(json.dumps({"jobs": [{**job, "cwd": str(job["cwd"])} for job in jobs], "parallel": parallel}))
        done = subprocess.run([sys.executable, __file__, str(spec), str(out)], env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads(out.read_text())
    return [
        subprocess.CompletedProcess(["elr", *job["args"]], r["returncode"], r["stdout"], r["stderr"])
        for job, r in zip(jobs, results)
    ]


def _child(job: dict, out: str, err: str) -> int:
    """In the forked process: the job's folder, environment, output files and arguments; returns the exit status."""
    import logging
    import traceback

    from elr_lightning.cli import main

    os.chdir(job["cwd"])
    os.environ.update(job["env"])
    for stream, path in ((sys.stdout, out), (sys.stderr, err)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, stream.fileno())
        os.close(fd)
    sys.argv = ["elr", *job["args"]]
    code = 0
    try:
        main()
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
        code = 1 if isinstance(stop.code, str) else stop.code or 0
    except BaseException:  # as the interpreter would: the traceback, status 1
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _serve(spec_path: str, out_path: str) -> None:
    """Import the CLI, then fork the jobs, ``parallel`` at a time; write their statuses and output."""
    import elr_lightning.cli  # noqa: F401 - what every child starts from

    spec = json.loads(Path(spec_path).read_text())
    jobs, parallel = spec["jobs"], spec["parallel"]
    folder = Path(out_path).parent
    running: dict[int, int] = {}
    statuses: dict[int, int] = {}

    def reap() -> None:
        pid, status = os.wait()
        statuses[running.pop(pid)] = os.waitstatus_to_exitcode(status)

    for i, job in enumerate(jobs):
        while len(running) >= parallel:
            reap()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(job, str(folder / f"{i}.out"), str(folder / f"{i}.err"))
            finally:
                os._exit(code)
        running[pid] = i
    while running:
        reap()
    results = [
        {"returncode": statuses[i], "stdout": (folder / f"{i}.out").read_text(errors="replace"),
         "stderr": (folder / f"{i}.err").read_text(errors="replace")}
        for i in range(len(jobs))
    ]  # fmt: skip
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    _serve(*sys.argv[1:])

"""Run entry points on hostile artifacts in this process, each under a 30 s alarm; print one JSON line per run.

``python _bounded_runner.py SPEC.json``: SPEC is a list of ``{"name", "cwd", "kind", "args"}``; ``kind``
``"cli"`` runs ``elr ARGS`` (``elr_lightning.cli.main``), ``"python"`` one of :data:`LOADERS` on ``args[0]``.
``python _bounded_runner.py SPEC.json BYTES`` first imports every module the entry points use, then bounds
this process's address space (``RLIMIT_AS``) to what it maps then plus BYTES, so the bound holds for every
run here together and counts what the hostile files cost, not the interpreter and its libraries (which map
more or less address space with the optional packages installed beside them). Each run prints ``{"name", "status", "said", "traceback"}``: the
``elr`` lines it printed (or the exception's message), and whether a traceback was printed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import traceback
from typing import Any, Callable

TIME_BOUND_S = 30

#: The tiny architecture a trainer's own model has (``_malicious.ARCH``).
ARCH = dict(vocab_size=256, d_model=16, n_heads=2, n_in=1, n_rec=1, n_out=0, max_seq_len=32, max_loops=2)


def _validate(path: str) -> Any:
    import lightning.pytorch as pl

    from elr_lightning.config import ModelConfig
    from elr_lightning.module import ELRModule

    trainer = pl.Trainer(callbacks=[], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu")  # fmt: skip
    return trainer.validate(ELRModule(arch=ModelConfig(**ARCH)), ckpt_path=path)


def _loaders() -> dict[str, Callable[[str], Any]]:
    from elr_lightning.checkpoints.io import verify_checkpoint_path
    from elr_lightning.inference.generate import load_model
    from elr_lightning.module import ELRModule

    return {
        "load_model": load_model,
        "load_model(meta=True)": lambda path: load_model(path, meta=True),
        "verify_checkpoint_path": verify_checkpoint_path,
        "ELRModule.load_from_checkpoint": ELRModule.load_from_checkpoint,
        "Trainer.validate, no callbacks": _validate,
    }


class _Timeout(BaseException):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one entry point in ``spec["cwd"]`` under the alarm; what it said."""
    os.makedirs(spec["cwd"], exist_ok=True)
    os.chdir(spec["cwd"])
    os.environ["ELR_MARKER"] = os.path.join(spec["cwd"], "MARKER")
    err = io.StringIO()
    status = "loaded"
    signal.alarm(TIME_BOUND_S)
    try:
        with contextlib.redirect_stderr(err):
            if spec["kind"] == "cli":
                from elr_lightning.cli import main

                main(spec["args"])
            else:
                _loaders()[spec["loader"]](spec["args"][0])
    except SystemExit as exit_:
        status = "refused" if exit_.code == 1 else f"exit {exit_.code}"
    except _Timeout:
        status = "timeout"
    except Exception as caught:  # a Python loader's refusal
        status = "refused"
        err.write("elr-python: " + " NEWLINE ".join(str(caught).splitlines()) + "\n")
        if not str(caught):
            err.write(traceback.format_exc())
    finally:
        signal.alarm(0)
    text = err.getvalue()
    said = [line for line in text.splitlines() if line.startswith("elr")]
    return {"name": spec["name"], "status": status, "said": said, "traceback": "Traceback" in text}


def _import_entry_points() -> None:
    """Import what the entry points import, so that the bound set after it counts only the runs."""
    import importlib

    import lightning.pytorch  # noqa: F401

    _loaders()
    for name in ("elr_lightning.cli", "elr_lightning.inference.command", "elr_lightning.eval.command",
                 "elr_lightning.hf.export", "elr_lightning.serve.command", "transformers", "tokenizers", "litserve"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def main() -> None:
    import resource

    signal.signal(signal.SIGALRM, _alarm)
    with open(sys.argv[1]) as f:
        specs = json.load(f)
    _import_entry_points()
    mapped = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + int(sys.argv[2]), resource.RLIM_INFINITY))
    for spec in specs:
        print(json.dumps(run_one(spec)), flush=True)


if __name__ == "__main__":
    main()

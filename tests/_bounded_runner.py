"""Run entry points on hostile artifacts in this process, each under a 30 s alarm; print one JSON line per run.

``python _bounded_runner.py SPEC.json``: SPEC is a list of ``{"name", "cwd", "kind", "args"}``; ``kind``
``"cli"`` runs ``elr ARGS`` (``elr_lightning.cli.main``), ``"python"`` one of :data:`LOADERS` on ``args[0]``.
The caller sets the address-space bound (``RLIMIT_AS``) when it starts this process, so it holds
for every run here together. Each run prints ``{"name", "status", "said", "traceback"}``: the
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


def main() -> None:
    signal.signal(signal.SIGALRM, _alarm)
    with open(sys.argv[1]) as f:
        specs = json.load(f)
    for spec in specs:
        print(json.dumps(run_one(spec)), flush=True)


if __name__ == "__main__":
    main()

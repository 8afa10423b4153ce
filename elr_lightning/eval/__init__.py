"""lm-evaluation-harness integration: the ``elr`` model adapter, the ``elr eval`` command, local tasks.

Importing :mod:`elr_lightning.eval.adapter` (or reading ``elr_lightning.eval.ELRLM``) registers
:class:`~elr_lightning.eval.adapter.ELRLM` with the harness under the name ``elr``; importing this
package alone does not import the harness, so ``elr eval`` on a depth-task checkpoint runs with the
core install. The harness's own command line does not import plugins, so run it with the adapter
imported first::

    python -c "import elr_lightning.eval.adapter, runpy; runpy.run_module('lm_eval', run_name='__main__')" \\
        --model elr --model_args ckpt_path=last.ckpt,loops=2 \\
        --include_path "$(python -c 'import elr_lightning.eval as e; print(e.TASKS_DIR)')" --tasks elr_local

The harness tasks need the optional extra ``eval`` (``pip install -e ".[eval]"`` in a checkout,
``pip install "elr-lightning[eval]"`` otherwise).
"""

from __future__ import annotations

import os
from typing import Any

from elr_lightning.eval.taskdata import TASKS, build_tasks, default_data_dir

#: Folder of the shipped task YAMLs: pass it to the harness as ``--include_path``.
TASKS_DIR: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")

#: The harness group of the shipped tasks.
LOCAL_GROUP = "elr_local"

__all__ = ["ELRLM", "LOCAL_GROUP", "TASKS", "TASKS_DIR", "build_tasks", "default_data_dir", "require_harness"]


def require_harness() -> None:
    """Import lm-evaluation-harness, or say in one line how to install it where the user is.

    Raises:
        ImportError: ``lm_eval`` does not import; the message names the install command.
    """
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        from elr_lightning.errors import install_extra

        raise ImportError(
            f"lm-evaluation-harness tasks need the eval extra; install it with {install_extra('eval')}"
        ) from err


def __getattr__(name: str) -> Any:
    """``ELRLM``, imported (with the harness) on first use: a depth-task evaluation never needs it."""
    if name == "ELRLM":
        require_harness()
        from elr_lightning.eval.adapter import ELRLM

        return ELRLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

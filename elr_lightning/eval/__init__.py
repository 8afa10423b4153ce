"""lm-evaluation-harness integration: the ``elr`` model adapter, the ``elr eval`` command, local tasks.

Importing this module registers :class:`~elr_lightning.eval.adapter.ELRLM` with the harness under
the name ``elr``. The harness's own command line does not import plugins, so run it with this
module imported first::

    python -c "import elr_lightning.eval, runpy; runpy.run_module('lm_eval', run_name='__main__')" \\
        --model elr --model_args ckpt_path=last.ckpt,loops=2 \\
        --include_path "$(python -c 'import elr_lightning.eval as e; print(e.TASKS_DIR)')" --tasks elr_local

Needs the optional extra ``pip install "elr-lightning[eval]"``.
"""

import os

try:
    import lm_eval  # noqa: F401
except ImportError as err:  # pragma: no cover - the extra is installed wherever this is tested
    raise ImportError('elr_lightning.eval needs lm-evaluation-harness; install it with pip install "elr-lightning[eval]"') from err

from elr_lightning.eval.adapter import ELRLM
from elr_lightning.eval.taskdata import TASKS, build_tasks, default_data_dir

#: Folder of the shipped task YAMLs: pass it to the harness as ``--include_path``.
TASKS_DIR: str = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")

#: The harness group of the shipped tasks.
LOCAL_GROUP = "elr_local"

__all__ = ["ELRLM", "LOCAL_GROUP", "TASKS", "TASKS_DIR", "build_tasks", "default_data_dir"]

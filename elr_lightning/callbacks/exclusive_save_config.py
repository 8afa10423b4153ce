"""LightningCLI's ``SaveConfigCallback`` that claims the run's log folder, so two runs never share it."""

from __future__ import annotations

import os
import socket
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.cli import SaveConfigCallback
from typing_extensions import override

#: The claim file in a run's log folder: ``<host> <pid>`` of the run that holds it.
CLAIM_FILE = ".elr-run.claim"


def claim_folder(folder: str) -> Optional[str]:
    """Claim ``folder`` for this process with an exclusively created :data:`CLAIM_FILE`.

    Creating the file with ``O_CREAT | O_EXCL`` is atomic: of two runs that picked the same
    folder at the same moment, exactly one succeeds. A claim left by a process that no longer runs
    on this host (a killed run being resumed) is taken over.

    Returns:
        ``None`` when this process holds the claim, else ``"<host> <pid>"`` of the holder.
    """
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, CLAIM_FILE)
    me = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path, encoding="utf-8") as f:
                    holder = f.read().strip()
            except FileNotFoundError:
                continue  # released in between: try again
            if holder == me or _is_gone(holder):
                os.remove(path)
                continue
            return holder
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(me)
        return None
    return f"{CLAIM_FILE} keeps being recreated in {folder}"


def _is_gone(holder: str) -> bool:
    host, _, pid = holder.partition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine's run: cannot tell, so it holds
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def release_folder(folder: str) -> None:
    """Remove this process' claim on ``folder`` (a no-op if it holds none)."""
    path = os.path.join(folder, CLAIM_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            if f.read().strip() == f"{socket.gethostname()} {os.getpid()}":
                os.remove(path)
    except FileNotFoundError:
        pass


class ExclusiveSaveConfig(SaveConfigCallback):
    """Saves the config like ``SaveConfigCallback``, after claiming the log folder for this run.

    ``elr`` overwrites ``config.yaml`` (a resumed run writes into its folder again), which turned
    off Lightning's guard against two runs in one folder: two runs launched at once picked the same
    ``version_0`` and mixed their configs, checkpoints and events. Rank 0 claims the folder with
    :func:`claim_folder` before writing anything; the second run is refused, naming the folder and
    the run that holds it. The claim is released at teardown.
    """

    _claimed: Optional[str] = None

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if not self.already_saved and self.save_to_log_dir and self._claimed is None:
            log_dir = trainer.log_dir  # broadcast from rank 0
            holder = claim_folder(log_dir) if trainer.is_global_zero and log_dir is not None else None
            holder = trainer.strategy.broadcast(holder)
            if holder is not None:
                raise FileExistsError(
                    f"the log folder {log_dir!r} is in use by another run (host and pid: {holder}); wait for it, "
                    "or give this run its own folder (trainer.logger's version or trainer.default_root_dir). If "
                    f"that run is gone, delete {os.path.join(log_dir, CLAIM_FILE)!r}"
                )
            self._claimed = log_dir
        super().setup(trainer, pl_module, stage)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self._claimed is not None and trainer.is_global_zero:
            release_folder(self._claimed)
        self._claimed = None

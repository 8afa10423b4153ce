"""``PreparedDataModule``: train on folders written by ``elr prepare``, one or a weighted mixture."""

from typing import Any, Optional, Union

from torch.utils.data import DataLoader, Subset
from typing_extensions import override

from elr_lightning.data.base import TokenDataModule
from elr_lightning.data.mixture import MixtureLoader
from elr_lightning.data.prepared import PreparedFolder, StreamWindows
from elr_lightning.data.windows import check_prefetch
from elr_lightning.tokenizers import Tokenizer, load_tokenizer


class PreparedDataModule(TokenDataModule):
    """Prepared folders -> a deterministic weighted mixture of windows of ``seq_len + 1`` tokens.

    Every batch is a ``torch.LongTensor`` of shape ``[batch_size, seq_len + 1]``, as from
    :class:`~elr_lightning.data.TextDataModule`. Training batches come from a
    :class:`~elr_lightning.data.mixture.MixtureLoader`: the batch at step ``s`` is a pure function of
    (seed, step, the folders' shards), memory is flat in corpus size, and a resume on another device
    count with the same ``batch_size x devices`` replays the same global batches (another global
    batch size is refused in one line). TensorBoard gets ``data/share/<folder>``, each source's
    realised share of the windows so far, every ``trainer.log_every_n_steps``.

    Validation reads the held-out documents of the training folders (``elr prepare
    --val_fraction``), or all documents of the ``validation`` folders when given: never windows of
    a training document. A validation folder with a training folder's fingerprint (the same folder,
    or a copy), or prepared from a file a training folder was prepared from, is refused.

    Args:
        folders: Prepared folders (one may be given alone, without a list).
        weights: One positive weight per folder (normalised); ``None`` for equal weights.
        validation: Prepared folders whose documents are the validation set, instead of the
            training folders' held-out documents.
        tokenizer: ``"byte"`` or the path of a HF ``tokenizer.json``: the one the folders were
            prepared with (checked by fingerprint).
        seq_len: Tokens the model sees per sequence (T).
        batch_size: Sequences per batch on each device.
        seed: Seed of the training order.
        val_batches: Use at most this many validation batches per device.
        prefetch: Training batches read ahead in a background thread while the step runs (0: read
            each when the step asks for it). The batches and the resume position do not depend on it.

    Raises:
        ValueError: A number is out of range, or the weights do not match the folders.
    """

    def __init__(
        self,
        folders: Union[list[str], str],
        weights: Optional[list[float]] = None,
        validation: Optional[Union[list[str], str]] = None,
        tokenizer: str = "byte",
        seq_len: int = 256,
        batch_size: int = 16,
        seed: int = 0,
        val_batches: Optional[int] = None,
        prefetch: int = 2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.folders = [folders] if isinstance(folders, str) else list(folders)
        self.validation = [validation] if isinstance(validation, str) else validation
        if not self.folders:
            raise ValueError("data.folders is empty; give the folders written by elr prepare")
        if weights is not None and len(weights) != len(self.folders):
            raise ValueError(
                f"data.weights has {len(weights)} value(s) for {len(self.folders)} folder(s); give one weight per folder"
            )
        if seq_len < 1:
            raise ValueError(f"data.seq_len must be >= 1, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if val_batches is not None and val_batches < 1:
            raise ValueError(f"data.val_batches must be >= 1 or null, got {val_batches}")
        self.weights = list(weights) if weights is not None else [1.0] * len(self.folders)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.val_batches = val_batches
        check_prefetch(prefetch)
        self.prefetch = prefetch
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer)
        self.sources: list[PreparedFolder] = []
        self.val_windows: Optional[StreamWindows] = None
        self._train_loader: Optional[MixtureLoader] = None

    @override
    def setup(self, stage: Optional[str] = None) -> None:
        """Open the folders, checking each index against the tokenizer and its shards."""
        self.sources = [PreparedFolder(path, self.tokenizer) for path in self.folders]
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.folders: two folders share a name ({names}); TensorBoard tags need distinct names")
        if self.validation is not None:
            streams = []
            for i, path in enumerate(self.validation):
                folder = PreparedFolder(path, self.tokenizer)
                self._check_held_out(i, folder)
                streams += [folder.train, folder.val]
        else:
            streams = [s.val for s in self.sources]
        self.val_windows = StreamWindows(streams, self.seq_len)
        self._train_loader = None

    def _check_held_out(self, i: int, folder: PreparedFolder) -> None:
        """Refuse validation folder ``i`` when it holds a training folder's data: the same index (a copy, or
        the folder itself), or a document file that a training folder was prepared from.

        Raises:
            ValueError: Naming both folders and the fix.
        """
        fix = (
            "validate on a folder prepared from other documents, or drop data.validation to use the training "
            "folders' held-out documents"
        )
        inputs = folder.input_files()
        for j, source in enumerate(self.sources):
            if folder.fingerprint() == source.fingerprint():
                raise ValueError(
                    f"data.validation[{i}]: {folder.path!r} is the same data as data.folders[{j}] {source.path!r} "
                    f"(fingerprint {source.fingerprint()[:12]}); {fix}"
                )
            shared = sorted(p for p, stat in source.input_files().items() if inputs.get(p) == stat)
            if shared:
                raise ValueError(
                    f"data.validation[{i}]: {folder.path!r} was prepared from {shared[0]!r}, which data.folders[{j}] "
                    f"{source.path!r} trains on; {fix}"
                )

    def _require_setup(self) -> StreamWindows:
        if self.val_windows is None:
            raise RuntimeError("PreparedDataModule.setup() must run before asking for a dataloader")
        return self.val_windows

    @override
    def train_dataloader(self) -> MixtureLoader:
        """The resumable mixture loader of this rank (one per setup)."""
        self._require_setup()
        rank, world_size = self._rank_and_world_size()
        loader = self._train_loader
        if loader is None or (loader.rank, loader.global_batch_size) != (rank, self.batch_size * world_size):
            loader = MixtureLoader(
                [s.train for s in self.sources],
                [s.name for s in self.sources],
                self.weights,
                [s.fingerprint() for s in self.sources],
                self.seq_len,
                self.batch_size,
                seed=self.seed,
                rank=rank,
                world_size=world_size,
                prefetch=self.prefetch,
            )
            self._train_loader = loader
        return loader

    @override
    def val_dataloader(self) -> DataLoader:
        """Validation windows in stream order, at most ``val_batches`` global batches (cut to a multiple of W).

        Raises:
            ValueError: There is no validation window while validation is requested.
        """
        val = self._require_setup()
        if len(val) == 0 and getattr(self.trainer, "limit_val_batches", 1) != 0:
            raise ValueError(
                "data.validation: the folders hold no validation window; prepare with --val_fraction > 0, give "
                "data.validation folders, or set trainer.limit_val_batches: 0"
            )
        count = self.validation_count(len(val))
        return DataLoader(Subset(val, range(count)), batch_size=self.batch_size, shuffle=False)

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Log each source's realised share to the trainer's logger every ``log_every_n_steps``."""
        trainer = self.trainer
        loader = self._train_loader
        if trainer is None or loader is None or not trainer.training or trainer.logger is None:
            return batch
        step = trainer.global_step
        if step % max(1, trainer.log_every_n_steps) == 0:
            shares = loader.schedule.share(loader.epoch * len(loader) + loader.position - 1)
            trainer.logger.log_metrics({f"data/share/{n}": v for n, v in zip(loader.names, shares)}, step=step)
        return batch

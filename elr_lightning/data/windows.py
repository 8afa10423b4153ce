"""Fixed windows over a token stream, and the step-indexed training loader that resumes exactly."""

import hashlib
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset
from typing_extensions import override

from elr_lightning.batches import Batch

class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` consecutive tokens over a token array.

    Window ``i`` (global index) covers tokens ``[i * seq_len, i * seq_len + seq_len + 1)``: windows
    overlap by one token, so every token of the stream is a target exactly once. This dataset holds
    the global windows ``[start, stop)``; its item ``j`` is global window ``start + j``.

    Args:
        tokens: The token stream, any 1-D array (a ``numpy.memmap`` in practice).
        seq_len: Model context T; each window holds T + 1 tokens.
        start: First global window index.
        stop: One past the last global window index.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int, stop: int) -> None:
        if start < 0 or stop < start or (stop > 0 and stop * seq_len + 1 > len(tokens)):
            raise ValueError(f"windows [{start}, {stop}) of {seq_len + 1} tokens exceed a stream of {len(tokens)}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.start = start
        self.stop = stop

    def __len__(self) -> int:
        """Number of windows."""
        return self.stop - self.start

    def __getitem__(self, index: int) -> torch.Tensor:
        """Window ``index`` as an ``int64`` tensor of shape ``[seq_len + 1]``."""
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        a = (self.start + index) * self.seq_len
        return torch.from_numpy(np.asarray(self.tokens[a : a + self.seq_len + 1], dtype=np.int64))

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        """Stack the given windows.

        Args:
            indices: Local window indices.

        Returns:
            An ``int64`` tensor of shape ``[len(indices), seq_len + 1]``.
        """
        return torch.stack([self[int(i)] for i in indices])


class Batchable(Protocol):
    """A dataset that stacks any of its items into one batch: :class:`TokenWindows`,
    :class:`~elr_lightning.data.labelled.LabelledExamples`."""

    def __len__(self) -> int:
        """Number of items."""

    def batch(self, indices: Sequence[int]) -> Batch:
        """The items ``indices`` as one batch."""


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of epoch ``epoch``'s permutation: 63 bits of SHA-256 of ``"seed:epoch"``.

    Args:
        seed: The data seed.
        epoch: Epoch number.

    Returns:
        A non-negative int suitable for ``torch.Generator.manual_seed``.
    """
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def check_prefetch(prefetch: object) -> None:
    """Refuse a ``data.prefetch`` that is not an integer >= 0, naming the field.

    Raises:
        ValueError: naming ``data.prefetch`` and what it must be.
    """
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"data.prefetch must be an integer >= 0 (0: no background reads), got {prefetch!r}")


class _Prefetcher:
    """Builds ``batch_at(epoch, p)`` for ``p = start, start + 1, ... < stop`` in a daemon thread, ``depth`` ahead.

    The batches come out in order through a queue of ``depth`` places, so the thread never runs more
    than ``depth`` batches ahead of the step. An exception raised by ``batch_at`` is handed over
    in the batch's place and raised by :meth:`get`, where the batch was asked for; the thread then
    stops. :meth:`close` stops the thread and waits for it to finish the batch it is building.

    Attributes:
        epoch: The epoch it reads.
        next: The position :meth:`get` returns next.
    """

    #: Seconds :meth:`close` waits for the thread to finish the batch it is building.
    JOIN_S = 30.0

    def __init__(
        self, batch_at: Callable[[int, int], Batch], epoch: int, start: int, stop: int, depth: int
    ) -> None:
        self.epoch, self.next = epoch, start
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(batch_at, epoch, start, stop), name="elr-data-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, batch_at: Callable[[int, int], Batch], epoch: int, start: int, stop: int) -> None:
        for position in range(start, stop):
            try:
                item: tuple[Optional[Batch], Optional[BaseException]] = (batch_at(epoch, position), None)
            except BaseException as err:  # raised in the training loop, at this batch
                item = (None, err)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[1] is not None:
                return

    def get(self) -> Batch:
        """The batch at :attr:`next` (waiting for it if it is not built yet); raises what building it raised."""
        while True:
            try:
                batch, err = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the data prefetch thread stopped before building the next batch") from None
        if err is not None:
            raise err
        self.next += 1
        return batch

    def close(self) -> None:
        """Stop the thread and wait for it (it finishes the batch it is building)."""
        self._stop.set()
        self._thread.join(self.JOIN_S)


class StepLoader(ABC):
    """A resumable training loader: batch ``p`` of epoch ``e`` is a pure function of its position.

    Contract for implementations: :meth:`batch_at` returns this rank's batch at ``(epoch,
    position)`` without any other state, ``__len__`` is the number of batches per epoch (greater
    than 0), and :meth:`layout` names everything a saved position depends on, so that a resume
    under another layout is refused instead of silently reading other data.

    The loader is a cursor over an endless sequence of epochs. Iterating yields the remaining
    batches of the current epoch; iterating again once the epoch is exhausted starts the next one.
    :meth:`state_dict` reports the number of batches already yielded, which Lightning saves in the
    checkpoint (its ``CombinedLoader`` calls ``state_dict`` on any loader that has one). Lightning
    does not fetch ahead from a loader that has ``__len__``, so at checkpoint time that number is
    exactly the number of batches trained on (checked in the tests with a real ``Trainer``).

    With ``prefetch`` > 0 a background thread builds the next batches of the epoch while the step
    runs (at most ``prefetch`` ahead; reading windows is I/O and NumPy, which release the GIL). The
    batches and the saved position are the same as without it: a batch counts as yielded when the
    loop takes it, and a batch is a pure function of its position. A cursor moved while iterating
    (:meth:`load_state_dict`) restarts the thread there. The thread stops when the epoch's batches
    are built, when the iterator is closed or dropped, and after an exception (raised where its
    batch is asked for).

    Args:
        batch_size: Windows per batch on this rank.
        rank: This process' rank.
        world_size: Number of processes sharing each global batch.
        prefetch: Batches built ahead in a background thread; 0 builds each when it is asked for.
    """

    #: How the refusal of a foreign layout tells the user to fix it.
    LAYOUT_FIX = "use the same data.seed, data.batch_size x devices and corpus, or start a fresh run"

    def __init__(self, batch_size: int, rank: int = 0, world_size: int = 1, prefetch: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        check_prefetch(prefetch)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.prefetch = prefetch
        self.epoch = 0
        self.position = 0

    @property
    def global_batch_size(self) -> int:
        """Windows per optimizer step over all ranks."""
        return self.batch_size * self.world_size

    @abstractmethod
    def __len__(self) -> int:
        """Batches per epoch on this rank."""

    @abstractmethod
    def batch_at(self, epoch: int, position: int) -> Batch:
        """This rank's batch at ``position`` of ``epoch``, without moving the cursor."""

    @abstractmethod
    def layout(self) -> dict[str, Any]:
        """What a saved position refers to (seed, global batch size, data identity)."""

    def __iter__(self) -> Iterator[Batch]:
        """Yield the rest of the current epoch, or all of the next one if the current is exhausted."""
        return self._generate()

    def _generate(self) -> Iterator[Batch]:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        ahead: Optional[_Prefetcher] = None
        try:
            while self.position < len(self):
                if not self.prefetch:
                    batch = self.batch_at(self.epoch, self.position)
                else:
                    if ahead is None or (ahead.epoch, ahead.next) != (self.epoch, self.position):
                        if ahead is not None:  # the cursor moved (load_state_dict): read from there
                            ahead.close()
                        ahead = _Prefetcher(self.batch_at, self.epoch, self.position, len(self), self.prefetch)
                    batch = ahead.get()
                self.position += 1
                yield batch
        finally:
            if ahead is not None:
                ahead.close()

    def state_dict(self) -> dict[str, Any]:
        """The cursor and the layout it is valid for.

        Returns:
            ``epoch`` and ``position`` (batches of that epoch already yielded), plus :meth:`layout`.
        """
        return {"epoch": self.epoch, "position": self.position, **self.layout()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Move the cursor to a saved state; the next batch yielded is the first one not yet trained.

        Args:
            state_dict: Output of :meth:`state_dict`.

        Raises:
            ValueError: The state was saved under another :meth:`layout`, so the saved position
                would name different data.
        """
        for key, mine in self.layout().items():
            if state_dict.get(key) != mine:
                raise ValueError(
                    f"cannot resume the data order exactly: checkpoint has {key}={state_dict.get(key)}, this run has "
                    f"{mine}; {self.LAYOUT_FIX}"
                )
        self.epoch = int(state_dict["epoch"])
        self.position = int(state_dict["position"])


class StepIndexedLoader(StepLoader):
    """Training batches as a pure function of (seed, epoch, position): resumes exactly.

    Epoch ``e`` visits the windows in the order of ``torch.randperm`` seeded with
    :func:`epoch_seed` ``(seed, e)``. Global batch ``p`` of the epoch is the ``batch_size *
    world_size`` consecutive windows of that permutation starting at ``p * batch_size *
    world_size``; rank ``r`` takes its slice ``[r * batch_size, (r + 1) * batch_size)``. The last
    incomplete global batch is dropped.

    Args:
        windows: The training windows, or any :class:`Batchable` dataset (labelled sequences:
            :class:`~elr_lightning.data.labelled.LabelledExamples`).
        batch_size: Windows per batch on this rank.
        seed: Data seed.
        rank: This process' rank.
        world_size: Number of processes sharing each global batch.
    """

    def __init__(
        self, windows: Batchable, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1
    ) -> None:
        super().__init__(batch_size, rank, world_size)
        self.windows = windows
        self.seed = seed
        self._order_epoch: Optional[int] = None
        self._order = torch.empty(0, dtype=torch.int64)

    @override
    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.windows) // self.global_batch_size

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._order = torch.randperm(len(self.windows), generator=generator)
            self._order_epoch = epoch
        return self._order

    @override
    def batch_at(self, epoch: int, position: int) -> Batch:
        """This rank's batch at ``position`` of ``epoch``, without moving the cursor.

        Args:
            epoch: Epoch number.
            position: Batch index within the epoch, below ``len(self)``.

        Returns:
            ``windows.batch`` of its ``batch_size`` items: for token windows an ``int64`` tensor of
            shape ``[batch_size, seq_len + 1]``.
        """
        if not 0 <= position < len(self):
            raise IndexError(f"batch {position} out of range for {len(self)} batches per epoch")
        first = position * self.global_batch_size + self.rank * self.batch_size
        return self.windows.batch(self._permutation(epoch)[first : first + self.batch_size].tolist())

    @override
    def layout(self) -> dict[str, Any]:
        """``seed``, ``global_batch_size`` and ``num_windows``."""
        return {"seed": self.seed, "global_batch_size": self.global_batch_size, "num_windows": len(self.windows)}

"""Tokenizers: the small seam between raw text and token ids.

Three implementations ship with the library:

* :class:`ByteTokenizer` -- ids 0..255 are the raw UTF-8 bytes. No dependency, no vocabulary file,
  every text round-trips exactly. The default.
* :class:`CharTokenizer` -- one id per character of a small alphabet (the depth tasks' vocabularies,
  :mod:`elr_lightning.depth`). No dependency; saved in checkpoints as its alphabet.
* :class:`HFTokenizer` -- wraps a Hugging Face ``tokenizers`` ``tokenizer.json`` (for example a
  byte-level BPE trained offline). Needs the optional extra ``pip install "elr-lightning[hf]"``.

:func:`load_tokenizer` turns the ``data.tokenizer`` string of a config into one of them.
"""

import contextlib
import hashlib
import itertools
import json
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Optional

import torch

from elr_lightning.errors import install_extra

EOS_CANDIDATES: tuple[str, ...] = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>")
"""Special tokens that :class:`HFTokenizer` accepts as end-of-sequence, in order of preference."""

TRIAL_CPU_S = 2.0
"""CPU seconds a ``tokenizer.json`` may take to encode and decode :func:`_trial_texts` when it is loaded."""


class TokenizerFailure(ValueError):
    """The ``tokenizers`` library's Rust code panicked on a text (a ``pyo3_runtime.PanicException``,
    which is a ``BaseException``), turned into a one-line ``ValueError``."""


def _is_panic(err: BaseException) -> bool:
    return type(err).__name__ == "PanicException"


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


@contextlib.contextmanager
def _quiet_stderr():
    """Send file descriptor 2 to the null device: a Rust panic hook writes its message (and with
    ``RUST_BACKTRACE`` a stack trace) there itself, around the Python exception."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to silence
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _patterns(spec: Any) -> list[str]:
    """Every regular expression a ``tokenizer.json`` holds (``{"Regex": ...}`` of Split, Replace, ...)."""
    if isinstance(spec, dict):
        found = [spec["Regex"]] if isinstance(spec.get("Regex"), str) else []
        return found + [p for value in spec.values() for p in _patterns(value)]
    if isinstance(spec, list):
        return [p for value in spec for p in _patterns(value)]
    return []


def _trial_texts(spec: dict[str, Any]) -> list[str]:
    """Texts that make a catastrophically backtracking pattern fail fast: each character of the
    tokenizer's own patterns (and of a few common classes) repeated, then one that ends the run."""
    chars = dict.fromkeys(" aA0_\n\t.,'-é中😀" + "".join(_patterns(spec)))
    return ["def f(x):\n    return x + 1  # ok, ça va? 中文 😀\n"] + [c * 64 + "\x00!" for c in list(chars)[:96]]


class Tokenizer(ABC):
    """Contract every tokenizer of the library fulfils.

    A tokenizer maps text to a list of integer ids in ``[0, vocab_size)`` and back. Besides the usual
    ``encode``/``decode`` it reports, per id, how many UTF-8 bytes of text the token stands for
    (:meth:`token_bytes`), so that losses can be reported in bits per byte, comparable across
    vocabularies, and a :meth:`fingerprint` that changes whenever the vocabulary does, so that
    cached token shards are never reused with the wrong tokenizer.
    """

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids: every id the tokenizer emits is in ``[0, vocab_size)``."""

    @property
    def eos_id(self) -> Optional[int]:
        """Id of the end-of-sequence token, or ``None`` when the vocabulary has none."""
        return None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Turn text into token ids.

        Args:
            text: Any Python string.

        Returns:
            The token ids, each in ``[0, vocab_size)``.
        """

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Turn token ids back into text.

        Args:
            ids: Token ids in ``[0, vocab_size)``.

        Returns:
            The text; byte sequences that are not valid UTF-8 are replaced by U+FFFD.
        """

    @abstractmethod
    def token_bytes(self) -> torch.Tensor:
        """Number of UTF-8 bytes of text each id stands for.

        Returns:
            An ``int64`` tensor of shape ``[vocab_size]``. The sum of its entries over the ids of
            ``encode(text)`` equals ``len(text.encode("utf-8"))`` for text without special tokens.
        """

    @abstractmethod
    def fingerprint(self) -> str:
        """Stable identifier of the vocabulary.

        Returns:
            A hex string that is equal for two tokenizers exactly when they map text to the same
            ids; stored in cache sidecars.
        """


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: id ``b`` is the byte ``b``; the vocabulary has 256 ids.

    There is no end-of-sequence id (:attr:`eos_id` is ``None``): all 256 ids are bytes of text.
    Decoding ids that do not form valid UTF-8 (possible for model samples) replaces the bad bytes
    with U+FFFD instead of raising.
    """

    @property
    def vocab_size(self) -> int:
        """Always 256."""
        return 256

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ints.

        Args:
            text: Any Python string.

        Returns:
            One id per UTF-8 byte.
        """
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids as UTF-8 bytes, replacing invalid sequences with U+FFFD.

        A model whose ``vocab_size`` exceeds 256 can sample an id that is no byte; each such id
        decodes to one U+FFFD, like an invalid byte, instead of failing the whole generation.

        Args:
            ids: Token ids; byte values in ``[0, 256)``.

        Returns:
            The decoded text.
        """
        pieces = []
        for is_byte, run in itertools.groupby(ids, key=lambda i: 0 <= i < 256):
            pieces.append(bytes(run).decode("utf-8", errors="replace") if is_byte else "\ufffd" * len(list(run)))
        return "".join(pieces)

    def token_bytes(self) -> torch.Tensor:
        """Every id stands for exactly one byte.

        Returns:
            ``torch.ones(256, dtype=torch.int64)``.
        """
        return torch.ones(self.vocab_size, dtype=torch.int64)

    def fingerprint(self) -> str:
        """Identifier of the fixed byte vocabulary.

        Returns:
            A constant hex digest.
        """
        return hashlib.sha256(b"elr_lightning.ByteTokenizer/utf-8").hexdigest()


class CharTokenizer(Tokenizer):
    """One id per character of ``alphabet``: id ``i`` is ``alphabet[i]``.

    Text holding a character outside the alphabet cannot be encoded (``ValueError`` naming it and
    the alphabet). There is no end-of-sequence id.

    Args:
        alphabet: The characters, each once.

    Raises:
        ValueError: An empty alphabet or a repeated character.
    """

    def __init__(self, alphabet: str) -> None:
        if not isinstance(alphabet, str) or not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"CharTokenizer alphabet {alphabet!r} must be a non-empty string of distinct characters")
        self.alphabet = alphabet
        self._ids = {c: i for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        """The alphabet's length."""
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        """One id per character.

        Raises:
            ValueError: A character of ``text`` is not in the alphabet.
        """
        try:
            return [self._ids[c] for c in text]
        except KeyError as err:
            raise ValueError(
                f"text holds {err.args[0]!r}, not in this tokenizer's alphabet {self.alphabet!r}; write only those characters"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        """The characters of ``ids``; an id outside the alphabet decodes to U+FFFD."""
        n = len(self.alphabet)
        return "".join(self.alphabet[i] if 0 <= i < n else "\ufffd" for i in ids)

    def token_bytes(self) -> torch.Tensor:
        """UTF-8 bytes of each character."""
        return torch.tensor([len(c.encode("utf-8")) for c in self.alphabet], dtype=torch.int64)

    def fingerprint(self) -> str:
        """SHA-256 of the alphabet."""
        return hashlib.sha256(f"elr_lightning.CharTokenizer/{self.alphabet}".encode()).hexdigest()


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the GPT-2 style byte-to-character table used by byte-level BPE.

    Bytes that are printable Latin-1 characters stand for themselves; the remaining bytes are
    assigned the code points 256, 257, ... in increasing byte order.

    Returns:
        Mapping from the character a byte-level vocabulary uses to the byte it stands for.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    printable_set = set(printable)
    table: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable_set:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(spec: dict[str, Any]) -> bool:
    """Whether a parsed ``tokenizer.json`` decodes with the byte-level decoder."""
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "ByteLevel":
        return True
    if decoder.get("type") == "Sequence":
        return any(d.get("type") == "ByteLevel" for d in decoder.get("decoders", []))
    return False


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file.

    The end-of-sequence id is the first of :data:`EOS_CANDIDATES` present in the vocabulary, or
    ``None``. :meth:`token_bytes` is exact for byte-level BPE (each vocabulary entry is mapped back
    to the bytes it encodes, so partial UTF-8 characters count correctly); for other decoders it is
    the UTF-8 length of the id decoded on its own. Special tokens count as zero bytes: they are not
    text.

    Args:
        path: Path of a ``tokenizer.json`` file.

    Raises:
        ImportError: The ``tokenizers`` package is not installed.
        FileNotFoundError: ``path`` does not exist.
        ValueError: The file is not a valid ``tokenizer.json``.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"data.tokenizer: tokenizer file {path!r} does not exist; "
                "give the path of a HF tokenizer.json or use 'byte'"
            )
        with open(path, "rb") as f:
            raw = f.read()
        self.path: Optional[str] = path
        self._load(raw, repr(path))

    @classmethod
    def from_json(cls, text: str) -> "HFTokenizer":
        """Build the tokenizer from the contents of a ``tokenizer.json`` rather than a file.

        Args:
            text: The JSON text, exactly as the file holds it (its fingerprint is that of the file).

        Returns:
            The tokenizer, with :attr:`path` ``None``.

        Raises:
            ImportError: The ``tokenizers`` package is not installed.
            ValueError: ``text`` is not a valid ``tokenizer.json``.
        """
        tok = cls.__new__(cls)
        tok.path = None
        tok._load(text.encode("utf-8"), "the saved tokenizer")
        return tok

    def _load(self, raw: bytes, origin: str) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as err:
            raise ImportError(
                'data.tokenizer: HF tokenizer files need the "tokenizers" package; '
                f"install it with {install_extra('hf')}"
            ) from err
        try:
            self._spec: dict[str, Any] = json.loads(raw)
            self._tok = _HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as err:  # tokenizers raises its own exception types for malformed files
            raise ValueError(f"data.tokenizer: {origin} is not a valid HF tokenizer.json ({err})") from err
        self._trial(origin)
        self._raw = raw
        self._fingerprint = hashlib.sha256(raw).hexdigest()
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._eos_id = next((vocab[t] for t in EOS_CANDIDATES if t in vocab), None)
        self._special_ids = {i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}
        self._token_bytes: Optional[torch.Tensor] = None

    def _trial(self, origin: str) -> None:
        """Encode and decode :func:`_trial_texts` once, refusing a tokenizer that panics or is slow on them.

        Raises:
            ValueError: The tokenizer panicked, or took over :data:`TRIAL_CPU_S` of CPU.
        """
        start = time.process_time()
        with _quiet_stderr():
            for text in _trial_texts(self._spec):
                try:
                    self._tok.decode(self._tok.encode(text, add_special_tokens=False).ids)
                except BaseException as err:
                    if not (_is_panic(err) or isinstance(err, Exception)):
                        raise
                    raise ValueError(
                        f"data.tokenizer: {origin} fails on a trial text ({_first_line(err)}); use a tokenizer.json "
                        "whose patterns do not backtrack catastrophically (or pass --tokenizer)"
                    ) from None
                if time.process_time() - start > TRIAL_CPU_S:
                    raise ValueError(
                        f"data.tokenizer: {origin} took over {TRIAL_CPU_S:g} s of CPU to encode a few kB of trial "
                        "text (a catastrophically backtracking pattern?); use another tokenizer.json (or pass --tokenizer)"
                    )

    def to_json(self) -> str:
        """The ``tokenizer.json`` text this tokenizer was built from (see :meth:`from_json`)."""
        return self._raw.decode("utf-8")

    @property
    def vocab_size(self) -> int:
        """One more than the largest id in the vocabulary, added tokens included."""
        return self._vocab_size

    @property
    def eos_id(self) -> Optional[int]:
        """Id of the first of :data:`EOS_CANDIDATES` in the vocabulary, or ``None``."""
        return self._eos_id

    def encode(self, text: str) -> list[int]:
        """Tokenise ``text`` with the wrapped tokenizer (no post-processor special tokens added).

        Args:
            text: Any Python string.

        Returns:
            The token ids.
        """
        return self._guard(lambda: self._tok.encode(text, add_special_tokens=False).ids, "encoding")

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids, keeping special tokens visible in the text.

        Args:
            ids: Token ids.

        Returns:
            The decoded text.
        """
        return self._guard(lambda: self._tok.decode(list(ids), skip_special_tokens=False), "decoding")

    @staticmethod
    def _guard(call: Any, what: str) -> Any:
        """``call()``, with a panic of the Rust library as a one-line :class:`TokenizerFailure`."""
        try:
            return call()
        except BaseException as err:
            if not _is_panic(err):
                raise
            raise TokenizerFailure(f"the tokenizer failed while {what} this text ({_first_line(err)})") from None

    def token_bytes(self) -> torch.Tensor:
        """UTF-8 bytes per id; special tokens and unused ids count zero.

        Returns:
            An ``int64`` tensor of shape ``[vocab_size]``.
        """
        if self._token_bytes is None:
            counts = torch.zeros(self._vocab_size, dtype=torch.int64)
            alphabet = _byte_level_alphabet() if _is_byte_level(self._spec) else None
            for token, i in self._tok.get_vocab(with_added_tokens=True).items():
                if i in self._special_ids:
                    continue
                if alphabet is not None and all(c in alphabet for c in token):
                    counts[i] = len(token)
                else:
                    counts[i] = len(self._tok.decode([i], skip_special_tokens=False).encode("utf-8"))
            self._token_bytes = counts
        return self._token_bytes.clone()

    def fingerprint(self) -> str:
        """SHA-256 of the ``tokenizer.json`` file contents.

        Returns:
            A hex digest.
        """
        return self._fingerprint


def load_tokenizer(spec: str) -> Tokenizer:
    """Build the tokenizer a config names.

    Args:
        spec: ``"byte"`` for :class:`ByteTokenizer`; otherwise the path of a HF ``tokenizer.json``
            (or of a directory containing one) for :class:`HFTokenizer`.

    Returns:
        The tokenizer.

    Raises:
        ValueError: ``spec`` is empty or the file is not a tokenizer.
        FileNotFoundError: The path does not exist.
        ImportError: A ``tokenizer.json`` was given but ``tokenizers`` is not installed.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"data.tokenizer must be 'byte' or the path of a HF tokenizer.json, got {spec!r}")
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.exists(spec):
        raise FileNotFoundError(
            f"data.tokenizer: {spec!r} does not exist; use 'byte' or the path of a HF tokenizer.json"
        )
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    return HFTokenizer(path)


class IncrementalDecoder:
    """Turn a growing list of token ids into text pieces as they become printable.

    Decodes the whole id list each step and emits the new suffix, holding back a trailing
    U+FFFD (an incomplete UTF-8 character of a byte-level vocabulary) until the next token
    completes it or :meth:`flush` is called. Assumes the decoding of a prefix of ids is a prefix
    of the decoding of the whole list, as for byte and byte-level BPE tokenizers.

    Args:
        tokenizer: The tokenizer to decode with.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        """Add one token id; return the text that became final (possibly empty)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Return whatever text is still held back."""
        return self._emit(self.tokenizer.decode(self.ids))

    def _emit(self, text: str) -> str:
        piece = text[len(self.emitted) :]
        self.emitted = text
        return piece

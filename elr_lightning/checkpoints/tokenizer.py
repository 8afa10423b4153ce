"""A tokenizer saved in a checkpoint and rebuilt from it, and the choice between it and a user's ``--tokenizer``."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Optional

from elr_lightning.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

TOKENIZER_STATE_FORMAT = 1
"""Version of the dictionary :func:`tokenizer_state` writes."""


def tokenizer_state(tokenizer: Tokenizer) -> dict[str, Any]:
    """A self-contained, JSON-serialisable description of ``tokenizer``, for checkpoints.

    A :class:`ByteTokenizer` is ``{"kind": "byte", ...}``; a :class:`CharTokenizer` carries its
    ``alphabet``; a :class:`HFTokenizer` carries the whole
    ``tokenizer.json`` text (not its path, so the checkpoint needs no other file). Both carry the
    :meth:`~elr_lightning.tokenizers.Tokenizer.fingerprint` and ``vocab_size``, checked again by :func:`tokenizer_from_state`.

    Args:
        tokenizer: One of the library's tokenizers.

    Returns:
        A dictionary of strings and ints.

    Raises:
        TypeError: ``tokenizer`` is another :class:`Tokenizer` subclass, which cannot be rebuilt.
    """
    common = {
        "format": TOKENIZER_STATE_FORMAT,
        "fingerprint": tokenizer.fingerprint(),
        "vocab_size": tokenizer.vocab_size,
    }
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte", **common}
    if isinstance(tokenizer, CharTokenizer):
        return {"kind": "chars", "alphabet": tokenizer.alphabet, **common}
    if isinstance(tokenizer, HFTokenizer):
        return {"kind": "hf", "tokenizer_json": tokenizer.to_json(), **common}
    raise TypeError(
        f"cannot save a {type(tokenizer).__name__} in a checkpoint; only ByteTokenizer, CharTokenizer and HFTokenizer are rebuilt "
        "from a state (use a HF tokenizer.json)"
    )


def tokenizer_from_state(state: Mapping[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer that :func:`tokenizer_state` described.

    Args:
        state: The dictionary, as saved.

    Returns:
        The tokenizer, with the saved fingerprint.

    Raises:
        ValueError: An unknown format or kind, or a rebuilt tokenizer whose fingerprint differs.
        ImportError: A HF tokenizer, but ``tokenizers`` is not installed.
    """
    if state.get("format") != TOKENIZER_STATE_FORMAT:
        raise ValueError(
            f"saved tokenizer: format {state.get('format')!r} is not {TOKENIZER_STATE_FORMAT}; "
            "upgrade elr-lightning or pass --tokenizer"
        )
    kind = state.get("kind")
    tokenizer: Tokenizer
    if kind == "byte":
        tokenizer = ByteTokenizer()
    elif kind == "chars" and isinstance(state.get("alphabet"), str):
        tokenizer = CharTokenizer(state["alphabet"])
    elif kind == "hf":
        tokenizer = HFTokenizer.from_json(state["tokenizer_json"])
    else:
        raise ValueError(f"saved tokenizer: unknown kind {kind!r} (expected 'byte', 'chars' or 'hf'); pass --tokenizer")
    if tokenizer.fingerprint() != state.get("fingerprint"):
        raise ValueError("saved tokenizer: rebuilt vocabulary does not match the saved fingerprint; pass --tokenizer")
    return tokenizer


def checkpoint_tokenizer(checkpoint: Mapping[str, Any]) -> Optional[Tokenizer]:
    """The training tokenizer saved in a loaded checkpoint dictionary.

    :class:`~elr_lightning.module.ELRModule` writes it under ``checkpoint["elr"]["tokenizer"]``
    whenever it was trained with a data module that has a tokenizer.

    Args:
        checkpoint: The dictionary ``torch.load`` returns for a Lightning checkpoint.

    Returns:
        The tokenizer, or ``None`` for a checkpoint that holds none (one written before tokenizers
        were saved, or trained without a data module).
    """
    elr = checkpoint.get("elr")
    state = elr.get("tokenizer") if isinstance(elr, Mapping) else None
    return tokenizer_from_state(state) if state is not None else None


def choose_tokenizer(saved: Optional[Tokenizer], override: Optional[str], vocab_size: int) -> Tokenizer:
    """The tokenizer a command runs a checkpoint with: the saved one unless overridden.

    Args:
        saved: The checkpoint's tokenizer (:func:`checkpoint_tokenizer`), or ``None``.
        override: A ``--tokenizer`` spec (``"byte"`` or a ``tokenizer.json`` path), or ``None``.
        vocab_size: The checkpoint's ``arch.vocab_size`` (rows of its embedding).

    Returns:
        ``override`` if given, else ``saved``, else a :class:`ByteTokenizer` (the default of
        checkpoints that saved none).

    Raises:
        ValueError: The chosen tokenizer has more ids than the embedding has rows.
    """
    if override is not None:
        tokenizer = load_tokenizer(override)
        source = f"--tokenizer {override!r}"
    elif saved is not None:
        tokenizer, source = saved, "the checkpoint's saved tokenizer"
    else:
        tokenizer, source = ByteTokenizer(), "the byte tokenizer (the checkpoint saved none)"
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"{source} has {tokenizer.vocab_size} ids but the checkpoint's arch.vocab_size is {vocab_size}; "
            "use the tokenizer the model was trained with (omit --tokenizer to use the saved one)"
        )
    if saved is not None and tokenizer.fingerprint() != saved.fingerprint():
        warnings.warn(f"{source} is not the tokenizer this checkpoint was trained with; its text may be garbage")
    return tokenizer

"""A tiny byte-level BPE trained in-process with HF ``tokenizers``, for tests that need real merges."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_text(limit: int = 12_000) -> str:
    """A few standard-library sources, cut to ``limit`` characters."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "json/decoder.py", "bisect.py")]
    return "\n".join(parts)[:limit]


def train_bpe(path: Path, vocab_size: int = 400, specials: tuple[str, ...] = ("<|endoftext|>",)) -> Path:
    """Train a byte-level BPE of ``vocab_size`` ids on :func:`stdlib_text`; save it as ``path``."""
    import tokenizers as hf

    tok = hf.Tokenizer(hf.models.BPE())
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([stdlib_text()], trainer=trainer)
    tok.save(str(path))
    return path

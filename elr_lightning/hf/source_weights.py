"""The tensors of a Hugging Face model folder, read one at a time: what ``elr retrofit`` builds from."""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePath
from typing import Optional

import torch
from torch import Tensor

__all__ = ["INDEX", "SafetensorsWeights"]

#: The index ``save_pretrained`` writes beside sharded weights: which file holds each tensor.
INDEX = "model.safetensors.index.json"


def _inside(name: str) -> bool:
    """Whether a file name an index gives stays inside the index's folder (checked as written, links aside)."""
    if not isinstance(name, str) or not name or PurePath(name).is_absolute():
        return False
    return ".." not in PurePath(os.path.normpath(name)).parts and os.path.normpath(name) != "."


class SafetensorsWeights:
    """The tensors of a model folder, read one at a time (``safetensors.safe_open``), never all at once.

    The folder's ``model.safetensors.index.json`` says which file holds each tensor, when it has one;
    any other ``*.safetensors`` beside it (a Mistral download's ``consolidated.safetensors``, a stale
    ``model.safetensors`` left next to newer shards) is not read. Without an index the folder must
    hold exactly one ``*.safetensors`` file.

    Args:
        directory: The model folder.
        dtype: Load every tensor as this dtype; ``None`` keeps each file's dtype.

    Every file the index names must lie inside the folder: a bare file name (or a relative path that
    stays below the folder), never an absolute path or one that climbs out with ``..``. Symbolic
    links inside the folder (a Hugging Face cache's snapshot points into its blobs) are the
    owner's layout and are followed.

    Raises:
        FileNotFoundError: No safetensors file, or a file the index names is missing.
        ValueError: Several ``*.safetensors`` files and no index, an unreadable index, or one that names
            a file outside the folder.
    """

    def __init__(self, directory: Path, dtype: Optional[torch.dtype] = None) -> None:
        from safetensors import safe_open

        self.dtype = dtype
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                outside = sorted({file for file in weight_map.values() if not _inside(file)})
                self.files = {name: directory / file for name, file in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
                raise ValueError(f"--hf: {str(index)!r} is not a safetensors index ({err}); download it again") from err
            if outside:
                raise ValueError(
                    f"--hf: {INDEX} names {outside[0]!r}, outside the folder {str(directory)!r}; an index names "
                    "files beside it, so download the model again"
                )
            missing = sorted({path.name for path in self.files.values() if not path.is_file()})
            if missing:
                raise FileNotFoundError(f"--hf: {INDEX} names {missing}, missing from {str(directory)!r}; download them")
            return
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"--hf {str(directory)!r} has no *.safetensors weights (model.safetensors or its shards); "
                "save the model with save_pretrained(safe_serialization=True)"
            )
        if len(files) > 1:
            raise ValueError(
                f"--hf {str(directory)!r} holds {len(files)} *.safetensors files ({', '.join(f.name for f in files)}) "
                f"and no {INDEX} to say which hold the model; add the model's index or move the other files out"
            )
        with safe_open(str(files[0]), framework="pt") as f:
            self.files = {name: files[0] for name in f.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __getitem__(self, name: str) -> Tensor:
        """Tensor ``name``, read alone from its file (memory-mapped until it is changed), in :attr:`dtype`.

        Raises:
            ValueError: No file holds ``name``.
        """
        from safetensors import safe_open

        if name not in self.files:
            raise ValueError(f"weights: {name} is missing from the safetensors files; give the complete checkpoint")
        with safe_open(str(self.files[name]), framework="pt") as f:
            tensor = f.get_tensor(name)
        return tensor if self.dtype is None else tensor.to(self.dtype)

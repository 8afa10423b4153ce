"""Reading a model folder's ``config.json`` as data: one JSON object, or a one-line refusal naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in ``path``.

    Args:
        path: The file (``config.json`` of an export or of a Hugging Face model folder).
        fix: What the user should give instead, ending the refusal (``"use the one `elr export` wrote"``).

    Raises:
        ValueError: The file is not UTF-8, not JSON, holds an integer of more digits than Python
            converts, nests deeper than Python's recursion limit, or holds no object: one line naming it.
    """
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"--hf {str(path)!r} nests too deeply to be a config.json; {fix}") from None
    except ValueError as err:  # not UTF-8, not JSON, or an integer of too many digits
        raise ValueError(f"--hf {str(path)!r} is not a readable config.json ({err}); {fix}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--hf {str(path)!r} holds a JSON {type(fields).__name__}, not an object; {fix}")
    return fields

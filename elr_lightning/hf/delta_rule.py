"""The gated delta-product recurrence of the Hugging Face remote code, inside the package.

``elr export`` ships :mod:`elr_lightning.mixers.delta_rule` itself under this file's name beside
``hybrid_elr.py``, so an export runs without ``elr_lightning``; in the package, ``hybrid_elr``'s
relative import lands here.
"""

from elr_lightning.mixers.delta_rule import delta_product, l2_normalize  # noqa: F401  (the export's module path)

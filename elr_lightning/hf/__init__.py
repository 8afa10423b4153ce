"""Hugging Face export and import (``elr export``, ``elr import``); needs the ``hf`` extra.

``configuration_elr.py`` and ``modeling_elr.py`` are the self-contained remote code copied into
every export; they import only ``torch`` and ``transformers``.
"""

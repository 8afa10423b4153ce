"""Running a trained model: generation, adaptive-depth decoding, prompts, cache policies, eq. 4 folding.

``generate`` (loading a checkpoint for inference, sampling, streaming), ``decode`` (the per-token decoder
and its depth policies), ``prompts`` (batches of prompts), ``fold`` (eq. 4's conditioning folded into the
weights), ``cache`` (cache policies) and ``command`` (``elr generate``). Imports the model, the module and
``checkpoints``; ``serve``, ``eval``, ``depth`` and ``hf`` build on it.
"""

"""Adaptive depth in the lm-eval adapter (``loops=auto``): its settings, its scoring, the loops it counts.

At ``loops="auto"`` each context is prefilled at the budget ``max_loops`` into a slot of a
:class:`~elr_lightning.inference.decode.Decoder`, and each continuation token is then decoded at its own
depth (:class:`~elr_lightning.inference.decode.AdaptiveDepth`: it leaves the recurrent block once its exit
criterion holds), so the scores are those of ``elr generate --loops auto`` over the same tokens.
The loops of the scored tokens are counted, for the mean loops per token ``elr eval`` reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from elr_lightning.inference.decode import AdaptiveDepth, Decoder, Depth


class AdaptiveScoring:
    """The ``loops="auto"`` part of :class:`~elr_lightning.eval.adapter.ELRLM`, a base class of it.

    Contract: the class that derives from it sets ``model`` (the looped LM), ``policy`` (a
    :class:`~elr_lightning.inference.cache.KVCache` class), ``autocast_dtype``, ``fold`` and ``loops`` (k or
    ``"auto"``), and calls :meth:`_setup_adaptive` once while it sets up.

    Attributes:
        max_loops: The budget K_max of ``loops="auto"``.
        threshold: Its exit threshold.
        exit_criterion: Its exit criterion (``kl`` or ``delta``).
        auto_loops: Loops of the continuation tokens scored at ``loops="auto"`` so far.
        auto_tokens: Those tokens; zero both to start a new count (:meth:`mean_loops`).
    """

    def _setup_adaptive(self, max_loops: int, threshold: float, exit_criterion: str) -> None:
        """Check and keep the settings of ``loops="auto"`` (``max_loops`` already checked against the checkpoint).

        Raises:
            ValueError: A bad ``threshold`` or ``exit_criterion``, naming it.
        """
        AdaptiveDepth(max_loops, threshold, exit_criterion)  # checks both, naming them
        self.max_loops, self.threshold, self.exit_criterion = max_loops, threshold, exit_criterion
        self.auto_loops, self.auto_tokens = 0, 0

    @property
    def depth(self) -> Depth:
        """What ``loops`` decodes at: k, or :class:`~elr_lightning.inference.decode.AdaptiveDepth` for ``"auto"``."""
        if self.loops == "auto":
            return AdaptiveDepth(self.max_loops, self.threshold, self.exit_criterion)
        return self.loops

    def mean_loops(self) -> Optional[float]:
        """Mean loops per continuation token scored at ``loops="auto"`` since ``auto_tokens`` was zeroed.

        A context's last position runs at the budget (the prompt is prefilled there), so the first
        continuation token counts ``max_loops``; tokens of ``generate_until`` are not counted.
        ``None`` before any token was scored.
        """
        return self.auto_loops / self.auto_tokens if self.auto_tokens else None

    def _adaptive_log_probs(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Tensor]:
        """Prefill each context at the budget, then decode its continuation with depth per token.

        Returns:
            Per ``(context, continuation)`` pair, the log-probabilities ``[n, V]`` of the
            continuation's ``n`` positions; the loops the tokens took are added to the counts.
        """
        need = max(len(ctx) + len(cont) - 1 for ctx, cont in pairs)
        decoder = Decoder(self.model, len(pairs), need, self.policy, self.autocast_dtype, self.fold)
        depth = self.depth
        steps = [[decoder.prefill(r, torch.tensor(ctx), depth)] for r, (ctx, _) in enumerate(pairs)]
        self.auto_loops, self.auto_tokens = self.auto_loops + depth.max_loops * len(pairs), self.auto_tokens + len(pairs)
        for j in range(max(len(cont) for _, cont in pairs) - 1):
            rows = [r for r, (_, cont) in enumerate(pairs) if j + 1 < len(cont)]
            tokens = torch.tensor([pairs[r][1][j] for r in rows])
            logits, used = decoder.step(rows, tokens, [depth] * len(rows))
            self.auto_loops, self.auto_tokens = self.auto_loops + int(used.sum()), self.auto_tokens + len(rows)
            for i, r in enumerate(rows):
                steps[r].append(logits[i])
        return [torch.stack(s).log_softmax(dim=-1) for s in steps]

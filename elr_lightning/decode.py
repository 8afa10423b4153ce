"""The one decode loop of generation and serving: rows in slots, each at its own position and depth.

A :class:`Decoder` holds a batch of *slots*, each a sequence with its own length in one
:class:`~elr_lightning.cache.KVCache`. :meth:`Decoder.prefill` runs a prompt alone into a free
slot (exactly the forward pass :func:`~elr_lightning.generation.generate` runs for one prompt);
:meth:`Decoder.step` decodes one token for any set of slots at once, whatever their lengths and
loop counts:

* the embedding, the input block, the final norm and the head run once over all rows;
* the recurrent block runs per *depth group* on the rows gathered for it, and the result is
  scattered back: rows at k loops cost k passes, so a step costs sum(k) row-loops, not
  max(k) x rows (DESIGN §7). A group is a fixed k, or an :class:`AdaptiveDepth` budget; each
  group decodes with its k's conditioning constants computed once
  (:func:`~elr_lightning.serving.serving_model`), so a row's logits are those of the model at its
  k, up to the fp32 round-off of batching (masked attention over the longest row's length);
* rows of an :class:`AdaptiveDepth` group run loop by loop under the budget's contexts
  c_i(i, K_max, K) (eq. 4), and a row leaves after loop i once its exit criterion holds
  (:data:`EXIT_CRITERIA`). Fewer rows run each later loop.

**Skipped loops' cache entries** (adaptive depth). Under a per-loop cache a row that exits at
loop e leaves loops e+1..K_max without an entry for its token; :meth:`KVCache.fill_skipped`
copies loop e's keys and values there, so later tokens attending at loop j > e see the exiting
token's deepest keys, as they would under ``last_loop``. Recurrent (linear-attention) state is
not copied: a skipped loop's state simply does not absorb the token. Under ``last_loop`` the one
store per layer already holds the exit loop's entry. A prompt prefilled in one pass runs at the
full budget K_max; only tokens decoded one at a time choose their depth.

A mixture-of-experts layer replays loop 1's routes while the rows of a loop are those of loop 1;
under adaptive depth, a loop whose rows shrank routes its rows again.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from elr_lightning.cache import KVCache, PolicyLike, resolve_policy
from elr_lightning.context import LoopContext, Positions
from elr_lightning.core import check_loops
from elr_lightning.fold import FoldedLM
from elr_lightning.model import LoopedLM
from elr_lightning.serving import serving_model

#: Exit criteria of :class:`AdaptiveDepth`, by name: what changed between loop i - 1 and loop i.
#:
#: * ``kl``: KL(p_i || p_{i-1}) of the next-token distributions read out through the output block
#:   and head after each loop (Huginn's criterion; costs one output pass per row and loop);
#: * ``delta``: ``||s_i - s_{i-1}|| / ||s_{i-1}||``, the relative change of the recurrent state
#:   (no extra pass).
#:
#: At loop 1 the previous state is s_0 (the injected input, ``StateUpdate.init``).
EXIT_CRITERIA = ("kl", "delta")


@dataclass(frozen=True)
class AdaptiveDepth:
    """Per-token depth: run up to ``max_loops`` loops, leave once the ``criterion`` drops below ``threshold``.

    Attributes:
        max_loops: The budget K_max; the loop contexts are those of k = K_max (eq. 4).
        threshold: Exit once the criterion's change is below it (0 never exits early).
        criterion: One of :data:`EXIT_CRITERIA`.
    """

    max_loops: int
    threshold: float
    criterion: str = "kl"

    def __post_init__(self) -> None:
        check_loops(self.max_loops)
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not (
            self.threshold >= 0 and math.isfinite(self.threshold)
        ):
            raise ValueError(f"threshold={self.threshold!r} must be a finite number >= 0")
        if self.criterion not in EXIT_CRITERIA:
            raise ValueError(f"criterion={self.criterion!r} must be one of {list(EXIT_CRITERIA)}")


#: How deep a row decodes: a fixed loop count k, or adaptive per token.
Depth = Union[int, AdaptiveDepth]


def budget(depth: Depth) -> int:
    """The most loops ``depth`` may run."""
    return depth.max_loops if isinstance(depth, AdaptiveDepth) else depth


def _group_key(depth: Depth) -> tuple:
    return ("auto", depth.max_loops, depth.criterion) if isinstance(depth, AdaptiveDepth) else ("k", depth)


class Decoder:
    """Slots of sequences in one KV cache, decoded together one token per :meth:`step`.

    Args:
        model: The looped LM, in eval mode.
        slots: Rows of the cache.
        max_len: Longest sequence a slot holds (prompt plus generated tokens).
        kv_cache: A policy name, a :class:`KVCache` subclass, or a fresh instance (``max_len`` from it).
        autocast_dtype: Run the model under ``torch.autocast`` with this dtype, or ``None``.
        fold: Decode with each k's conditioning constants (:func:`~elr_lightning.serving.serving_model`).
    """

    def __init__(
        self,
        model: LoopedLM,
        slots: int,
        max_len: int,
        kv_cache: Union[PolicyLike, KVCache] = "per_loop",
        autocast_dtype: Optional[torch.dtype] = None,
        fold: Optional[bool] = None,
    ) -> None:
        self.model, self.fold = model, fold
        self.cache = kv_cache if isinstance(kv_cache, KVCache) else resolve_policy(kv_cache)(max_len=max_len)
        self.cache.slots = slots
        self.lengths = [0] * slots
        self.device = model.embed.weight.device
        self.autocast_dtype = autocast_dtype
        config = model.config
        self.rec_layers = [config.layer_index("rec", j) for j in range(config.n_rec)]

    def amp(self) -> contextlib.AbstractContextManager:
        """Autocast to the decoder's dtype, or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def runner(self, loops: int) -> Union[LoopedLM, FoldedLM]:
        """The module that decodes at ``loops`` (chosen per group and step, kept per k by ``serving_model``)."""
        return serving_model(self.model, loops, self.fold)

    @torch.inference_mode()
    def prefill(self, slot: int, ids: Tensor, depth: Depth) -> Tensor:
        """Run ``ids`` ``[T]`` alone into ``slot`` (its old content is dropped); return the last logits ``[V]``.

        A prompt runs in one pass at ``budget(depth)`` loops: the forward pass of the model at that k.
        """
        loops = budget(depth)
        view = self.cache.rows(torch.tensor([slot], device=self.device), None, ids.shape[0], fresh=True)
        with self.amp():
            logits = self.runner(loops)(ids[None].to(self.device), loops, None, view)[0, -1].float()
        self.lengths[slot] = ids.shape[0]
        self.cache.offset = max(self.lengths)
        return logits

    @torch.inference_mode()
    def step(self, slots: list[int], tokens: Tensor, depths: list[Depth]) -> tuple[Tensor, Tensor]:
        """Feed ``tokens`` ``[n]`` to ``slots`` at their own depths; return logits ``[n, V]`` and loops used ``[n]``."""
        device, lm = self.device, self.model
        rows = torch.tensor(slots, device=device)
        pos = torch.tensor([self.lengths[s] for s in slots], device=device)
        end = max(self.lengths[s] for s in slots) + 1
        if end > self.cache.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens exceed max_len={self.cache.max_len}")
        full = _Rows(lm, self.cache, rows, pos, end)
        used = torch.zeros(len(slots), dtype=torch.long)
        with self.amp():
            x = lm.embed(tokens.to(device)[:, None])
            ctx = full.context(0, 1)
            for layer in lm.input_layers:
                x = layer(x, ctx)
            out = torch.empty_like(x)
            groups: dict[tuple, list[int]] = {}
            for i, depth in enumerate(depths):
                groups.setdefault(_group_key(depth), []).append(i)
            for members in groups.values():
                idx = torch.tensor(members, device=device)
                depth = depths[members[0]]
                sub = full.subset(idx)
                if isinstance(depth, AdaptiveDepth):
                    thresholds = torch.tensor([depths[m].threshold for m in members], device=device)
                    out[idx], used[idx] = self._adaptive(sub, x[idx], depth, thresholds)
                else:
                    out[idx] = self._fixed(sub, x[idx], depth)
                    used[idx] = depth
            logits = lm.head(lm.norm(out))[:, -1].float()
        self.cache.commit()
        for s in slots:
            self.lengths[s] += 1
        self.cache.offset = max(self.lengths)
        return logits, used

    def _fixed(self, rows: "_Rows", h_in: Tensor, loops: int) -> Tensor:
        runner = self.runner(loops)
        ctx = rows.context(0, loops)
        s, c = runner.core(h_in, ctx)
        return _output(runner, s, ctx.at(0, c))

    def _adaptive(self, rows: "_Rows", h_in: Tensor, depth: AdaptiveDepth, thresholds: Tensor) -> tuple[Tensor, Tensor]:
        """Loop by loop under the budget's contexts; a row leaves once its change is below its threshold."""
        m = depth.max_loops
        runner = self.runner(m)
        core, conditioner = runner.core, runner.core.conditioner
        state = core.update.init(h_in).clone()  # written row by row below; init may return h_in itself
        used = torch.full((h_in.shape[0],), m, dtype=torch.long)
        active = torch.arange(h_in.shape[0], device=h_in.device)
        view = rows
        prev_logp = _log_probs(runner, state, view.context(0, m)) if depth.criterion == "kl" else None
        c = None
        for i in range(1, m + 1):
            if conditioner is not None:
                c = conditioner(i, m, self.model.config.max_loops, h_in)
            s_prev = state[active]
            s = core.loop(s_prev, h_in[active], view.context(i, m, c))
            state[active] = s
            if i == m:
                break
            if depth.criterion == "kl":
                logp = _log_probs(runner, s, view.context(0, m, c))
                change = F.kl_div(prev_logp, logp, log_target=True, reduction="none").sum(-1)[:, -1]
            else:
                change = (s - s_prev).norm(dim=-1)[:, -1] / s_prev.norm(dim=-1)[:, -1].clamp_min(1e-12)
            leave = change < thresholds[active]
            if bool(leave.any()):
                exited = active[leave]
                used[exited.cpu()] = i
                self.cache.fill_skipped(view.rows[leave], view.pos[leave], self.rec_layers, i, m)
                keep = ~leave
                active, view = active[keep], view.subset(keep.nonzero().squeeze(-1))
                if prev_logp is not None:
                    prev_logp = logp[keep]
                if active.numel() == 0:
                    break
            elif prev_logp is not None:
                prev_logp = logp
        c_out = None if conditioner is None else conditioner(m, m, self.model.config.max_loops, h_in)
        return _output(runner, state, rows.context(0, m, c_out)), used


def _output(runner: Union[LoopedLM, FoldedLM], s: Tensor, ctx: LoopContext) -> Tensor:
    for layer in runner.output_layers:
        s = layer(s, ctx)
    return s


def _log_probs(runner: Union[LoopedLM, FoldedLM], s: Tensor, ctx: LoopContext) -> Tensor:
    """Next-token log-probabilities read out from state ``s`` through the output block and head."""
    return runner.head(runner.norm(_output(runner, s, ctx))).float().log_softmax(-1)


class _Rows:
    """Some rows of a slot cache at their own positions: the loop contexts a decode step runs them under."""

    def __init__(self, model: LoopedLM, cache: KVCache, rows: Tensor, pos: Tensor, end: int) -> None:
        self.model, self.cache, self.rows, self.pos, self.end = model, cache, rows, pos, end
        cos, sin = model.rotary(0, end)
        self.cos, self.sin = cos[pos][:, None, None], sin[pos][:, None, None]
        self.mask = (torch.arange(end, device=pos.device)[None, :] <= pos[:, None])[:, None, None]
        self.view = cache.rows(rows, pos[:, None], end)

    def subset(self, idx: Tensor) -> "_Rows":
        """The rows at ``idx`` of these."""
        return _Rows(self.model, self.cache, self.rows[idx], self.pos[idx], self.end)

    def context(self, loop: int, loops: int, cond: Optional[Tensor] = None) -> LoopContext:
        """A fresh loop context of these rows (its scratch is its own)."""
        positions = Positions(self.cos, self.sin, self.mask, False, None, self.end - 1)
        return LoopContext(positions, loops, self.model.config.max_loops, loop=loop, cond=cond, cache=self.view)

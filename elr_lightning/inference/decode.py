"""The one decode loop of generation and serving: rows in slots, each at its own position and depth.

A :class:`Decoder` holds a batch of *slots*, each a sequence with its own length in one
:class:`~elr_lightning.inference.cache.KVCache`. :meth:`Decoder.prefill` runs a prompt alone into a free
slot (exactly the forward pass :func:`~elr_lightning.inference.generate.generate` runs for one prompt);
:meth:`Decoder.step` decodes one token for any set of slots at once, whatever their lengths and
loop counts:

* the embedding, the input block, the final norm and the head run once over all rows;
* rows all at one k run the recurrent and output blocks at k with its conditioning constants
  computed once (:func:`~elr_lightning.inference.fold.serving_model`), exactly as :meth:`Decoder.prefill`
  and :func:`~elr_lightning.inference.generate.generate` do;
* otherwise loop i runs once, on the rows whose k reaches it, each row under its own context
  c_i(i, k, K) (eq. 4's operands computed once per (sublayer, i, k) and stacked per row): a step
  costs sum(k) row-loops, not max(k) x rows (DESIGN §7), and a row's logits equal those of its k
  alone to fp32 round-off. The rows are put in order of budget before the input block, so the rows
  of loop i are a prefix of the batch and run as views; only rows thinned by adaptive exits are
  gathered;
* an :class:`AdaptiveDepth` row runs under the contexts of its budget K_max and leaves after loop
  i once its exit criterion holds (:data:`EXIT_CRITERIA`); fewer rows run each later loop.

**Skipped loops' cache entries** (adaptive depth). Under a per-loop cache a row that exits at
loop e leaves loops e+1..K_max without an entry for its token; :meth:`KVCache.fill_skipped`
copies loop e's keys and values there, so later tokens attending at loop j > e see the exiting
token's deepest keys, as they would under ``last_loop``. Recurrent (linear-attention) state is
not copied: a skipped loop's state simply does not absorb the token. Under ``last_loop`` the one
store per layer already holds the exit loop's entry. A prompt prefilled in one pass runs at the
full budget K_max; only tokens decoded one at a time choose their depth.

**Route replay.** A mixture-of-experts layer that replays loop 1's routes does so in every step.
Every row runs loop 1; a later loop runs on some of the rows under a view of loop 1's context
naming them (``LoopContext.rows``, sharing its scratch), so the layer cuts loop 1's dispatch
plan to those rows and each row replays its own routes, as it does decoded alone (an adaptive
row too, so ``threshold=0`` is fixed k at the budget). Before, each loop of a mixed step routed
again: 0.064 max logit gap to the rows alone on a perturbed tiny MoE, now 7e-7.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elr_lightning.inference.cache import KVCache, PolicyLike, resolve_policy
from elr_lightning.context import LoopContext, Positions
from elr_lightning.core import check_loops
from elr_lightning.model import LoopedLM
from elr_lightning.inference.fold import FoldedLM, split_constants, serving_model

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


class Decoder:
    """Slots of sequences in one KV cache, decoded together one token per :meth:`step`.

    Args:
        model: The looped LM, in eval mode.
        slots: Rows of the cache.
        max_len: Longest sequence a slot holds (prompt plus generated tokens).
        kv_cache: A policy name, a :class:`KVCache` subclass, or a fresh instance (``max_len`` from it).
        autocast_dtype: Run the model under ``torch.autocast`` with this dtype, or ``None``.
        fold: Decode with each k's conditioning constants (:func:`~elr_lightning.inference.fold.serving_model`).
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
        self._runners: dict[int, Union[LoopedLM, FoldedLM]] = {}
        self._contexts: dict[tuple[int, int], Tensor] = {}
        self._constants = _RowConstants()
        config = model.config
        self.rec_layers = [config.layer_index("rec", j) for j in range(config.n_rec)]

    def amp(self) -> contextlib.AbstractContextManager:
        """Autocast to the decoder's dtype, or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def runner(self, loops: int) -> Union[LoopedLM, FoldedLM]:
        """The module that decodes at ``loops``: :func:`~elr_lightning.inference.fold.serving_model`, asked once per k.

        Kept for the decoder's life, which must not outlast a change of the weights (a decoder
        serves one generation, or a server's inference worker).
        """
        if loops not in self._runners:
            self._runners[loops] = serving_model(self.model, loops, self.fold)
        return self._runners[loops]

    def reset(self) -> None:
        """Empty every slot after a failed :meth:`prefill` or :meth:`step`.

        A pass that fails mid-way leaves the recurrent state its earlier layers recorded waiting for
        the next commit, which would write it into the slots; it is dropped, and every slot's length
        is 0 again. The keys and values need no clearing: a slot's next prompt overwrites its
        positions from 0, and positions past a row's length are masked.
        """
        self.cache.discard()
        self.lengths = [0] * len(self.lengths)
        self.cache.offset = 0

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
        """Feed ``tokens`` ``[n]`` to ``slots`` at their own depths; return logits ``[n, V]`` and loops used ``[n]``.

        Rows all at one fixed k run the model at k with its conditioning constants (exactly what
        :meth:`prefill` runs); otherwise loop i runs once on the rows still needing it (see
        :meth:`_looped_sorted`).
        """
        device, lm = self.device, self.model
        single = all(isinstance(d, int) and d == depths[0] for d in depths)
        # Mixed depths: the rows in order of budget, deepest first (stable), so that the rows of
        # loop i are a prefix of the batch (see _looped_sorted); the logits go back to the
        # callers' order at the end.
        order = None if single else sorted(range(len(slots)), key=lambda r: -budget(depths[r]))
        if order is not None and order != list(range(len(slots))):
            slots, depths = [slots[r] for r in order], [depths[r] for r in order]
            tokens = tokens[torch.tensor(order, device=tokens.device)]
        else:
            order = None
        rows = torch.tensor(slots, device=device)
        pos = torch.tensor([self.lengths[s] for s in slots], device=device)
        end = max(self.lengths[s] for s in slots) + 1
        if end > self.cache.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens exceed max_len={self.cache.max_len}")
        every = _Rows(lm, self.cache, rows, pos, end)
        with self.amp():
            x = lm.embed(tokens.to(device)[:, None])
            ctx = every.context(0, 1)
            for layer in lm.input_layers:
                x = layer(x, ctx)
            if single:
                runner = self.runner(depths[0])
                ctx = every.context(0, depths[0])
                s, c = runner.core(x, ctx)
                out = _output(runner, s, ctx.at(0, c))
                used = torch.full((len(slots),), depths[0], dtype=torch.long)
            else:
                out, used = self._looped_sorted(every, x, depths)
            logits = lm.head(lm.norm(out))[:, -1].float()
        self.cache.commit()
        for s in slots:
            self.lengths[s] += 1
        self.cache.offset = max(self.lengths)
        if order is not None:
            back = torch.empty(len(order), dtype=torch.long)
            back[torch.tensor(order)] = torch.arange(len(order))
            return logits[back.to(logits.device)], used[back]
        return logits, used

    def _row_context(self, loop: int, budgets: list[int], like: Tensor) -> Optional[_RowContext]:
        """Per-row context (eq. 4) of loop ``loop`` >= 1, c_i(i, k_row, K), or of the output block (``loop`` 0),
        c_k(k_row, k_row, K); each (i, k) computed once per decoder. ``None`` without active conditioning."""
        conditioner = self.model.conditioner
        if conditioner is None or not conditioner.active:
            return None
        for k in set(budgets):
            if (loop, k) not in self._contexts:
                self._contexts[(loop, k)] = conditioner(loop or k, k, self.model.config.max_loops, like)
        return _RowContext(loop, tuple(budgets), self._contexts, self._constants)

    def _looped_sorted(self, rows: "_Rows", h_in: Tensor, depths: list[Depth]) -> tuple[Tensor, Tensor]:
        """Loop i once over the rows still needing it, each under its own context; adaptive rows may leave.

        The model's own layers run with a per-row context (the conditioner's heads per row rather
        than constants per k), so a row's logits equal those of its k alone to fp32 round-off.

        The rows come in order of budget, deepest first (:meth:`step` puts them so), so the rows of
        loop i are a prefix of the batch: each loop then runs on views (state, input, positions,
        cache rows), and only a loop whose rows are not a prefix (after adaptive exits) gathers and
        scatters them.
        """
        core, n = self.model.core, h_in.shape[0]
        budgets = [budget(d) for d in depths]
        adaptive = [isinstance(d, AdaptiveDepth) for d in depths]
        any_adaptive = any(adaptive)
        state = core.update.init(h_in).clone()  # written row by row below; init may return h_in itself
        used = torch.tensor(budgets)
        c_out = self._row_context(0, budgets, h_in)
        if any_adaptive:
            thresholds = torch.tensor([d.threshold if isinstance(d, AdaptiveDepth) else -1.0 for d in depths])
            kl = torch.tensor([isinstance(d, AdaptiveDepth) and d.criterion == "kl" for d in depths])
            left = torch.ones(n, dtype=torch.bool)  # not exited
            prev_logp: dict[int, Tensor] = {}
            if bool(kl.any()):
                idx = kl.nonzero().squeeze(-1)
                prev_logp = dict(zip(idx.tolist(), self._log_probs(rows, state, idx, c_out)))
        first = rows.context(1, budgets[0])  # every row runs loop 1; later loops read its scratch (replayed routes)
        exited = False
        for i in range(1, budgets[0] + 1):
            if exited:  # the rows still in and deep enough
                active = (left & (used >= i)).nonzero().squeeze(-1)
                m = active.numel()
                if m == 0:
                    break
                prefix = int(active[-1]) == m - 1
            else:  # no row left early: the rows of budget >= i, a prefix
                m, active, prefix = sum(b >= i for b in budgets), None, True
            if prefix:  # views
                sub, at = rows.prefix(m), slice(0, m)
            else:
                at = active.to(h_in.device)
                sub = rows.subset(at)
            c = self._row_context(i, budgets[:m] if prefix else [budgets[r] for r in active.tolist()], h_in)
            s_prev = state[at]
            s = _loop_rows(core, s_prev, h_in[at], sub.within(first, i, None if sub is rows else at), c)
            if not any_adaptive:
                state[at] = s
                continue
            active = torch.arange(m) if active is None else active
            checks = [j for j, r in enumerate(active.tolist()) if adaptive[r] and i < budgets[r]]
            if checks:  # measured before the write below: on a prefix, s_prev is a view of state
                check = torch.tensor(checks)
                change = (s - s_prev).norm(dim=-1)[:, -1] / s_prev.norm(dim=-1)[:, -1].clamp_min(1e-12)
                change = change.float().cpu()[check]
            state[at] = s
            if not checks:
                continue
            by_kl = [j for j in checks if kl[active[j]]]
            if by_kl:
                logp = self._log_probs(rows, state, active[by_kl], c_out)
                for j, lp in zip(by_kl, logp):
                    r = int(active[j])
                    value = F.kl_div(prev_logp[r], lp, log_target=True, reduction="sum").float().cpu()
                    change[checks.index(j)] = value
                    prev_logp[r] = lp
            leave = active[check[change < thresholds[active[check]]]]
            if leave.numel():
                used[leave], left[leave], exited = i, False, True
                for e in leave.tolist():
                    self.cache.fill_skipped(rows.rows[e : e + 1], rows.pos[e : e + 1], self.rec_layers, i, budgets[e])
        return _output_rows(self.model, state, rows.context(0, budgets[0]), c_out), used

    def _log_probs(self, rows: "_Rows", state: Tensor, idx: Tensor, c_out: Optional[_RowContext]) -> Tensor:
        """Next-token log-probabilities ``[m, V]`` of rows ``idx`` read out from ``state`` through the output block."""
        sub = rows.subset(idx.to(state.device))
        cond = None if c_out is None else _RowContext(0, tuple(c_out.ks[j] for j in idx.tolist()), c_out.contexts, c_out.cache)
        out = _output_rows(self.model, state[idx.to(state.device)], sub.context(0, 1), cond)
        return self.model.head(self.model.norm(out))[:, -1].float().log_softmax(-1)


def _output(runner: Union[LoopedLM, FoldedLM], s: Tensor, ctx: LoopContext) -> Tensor:
    for layer in runner.output_layers:
        s = layer(s, ctx)
    return s


class _RowConstants:
    """Eq. (4)'s operands per sublayer in the split form, stacked per row of a step, and the stacked contexts.

    The split form is :class:`~elr_lightning.inference.fold.ConditionedBlock`'s on the CPU (the norm's
    per-token scalar taken after the pre-map), so a row runs the op sequence of its k decoded alone:
    ``(u, down^T, up^T, shift, root_eps, gate)``, each but ``root_eps`` with a leading row axis.
    Each (sublayer, i, k) is computed once from the modulator's ``modulation`` (the conditioner's
    heads do not run per token); the stack for a step's row pattern is kept while the pattern
    recurs. Modulators without ``modulation`` get ``None`` and run through ``pre`` and ``post``.
    """

    def __init__(self) -> None:
        self.single: dict[tuple[int, int, int], Optional[tuple]] = {}
        self.stacked: dict[tuple, Optional[tuple]] = {}

    def get(self, norm: nn.RMSNorm, mod: nn.Module, loop: int, ks: tuple[int, ...], contexts: dict) -> Optional[tuple]:
        """The stacked operands of sublayer ``(norm, mod)`` at ``loop`` for rows of budgets ``ks``, or ``None``."""
        key = (id(mod), loop, ks)
        if key not in self.stacked:
            parts = [self._one(norm, mod, loop, k, contexts[(loop, k)]) for k in ks]
            if any(p is None for p in parts):
                stacked = None
            else:
                u, down, up, shift, root_eps, gate = zip(*parts)
                stacked = (
                    torch.stack(u)[:, None], torch.stack(down).transpose(1, 2).contiguous(),
                    torch.stack(up).transpose(1, 2).contiguous(), torch.stack(shift)[:, None], root_eps[0],
                    torch.stack(gate)[:, None],
                )  # fmt: skip
            self._keep(key, stacked)
        return self.stacked[key]

    def cond(self, loop: int, ks: tuple[int, ...], contexts: dict) -> Tensor:
        """The contexts ``[n, 1, d_cond]`` of rows of budgets ``ks`` at ``loop``."""
        key = ("cond", loop, ks)
        if key not in self.stacked:
            self._keep(key, torch.stack([contexts[(loop, k)] for k in ks])[:, None])
        return self.stacked[key]

    def _keep(self, key: tuple, value: Optional[Union[tuple, Tensor]]) -> None:
        if len(self.stacked) > 512:
            self.stacked.clear()
        self.stacked[key] = value

    def _one(self, norm: nn.RMSNorm, mod: nn.Module, loop: int, k: int, c: Tensor) -> Optional[tuple]:
        key = (id(mod), loop, k)
        if key not in self.single:
            try:
                self.single[key] = split_constants(norm, mod, c)
            except NotImplementedError:
                self.single[key] = None
        return self.single[key]


def _block_rows(block: nn.Module, x: Tensor, ctx: LoopContext, rows: Optional["_RowContext"]) -> Tensor:
    """A :class:`~elr_lightning.layers.Block` with its own context per row (eq. 4), one token per row."""
    for norm, mixer, mod in ((block.attn_norm, block.attn, block.attn_mod), (block.mlp_norm, block.mlp, block.mlp_mod)):
        consts = None if rows is None or mod is None else rows.constants(norm, mod)
        if rows is None or mod is None:
            x = x + mixer(norm(x), ctx, block.index)
        elif consts is None:  # a modulator without a constant form: its heads per row
            cond = rows.cond()
            x = x + mod.post(mixer(mod.pre(norm(x), cond), ctx, block.index), cond)
        else:  # serving's split form (``_split_residual``), each row with its own operands
            u, down_t, up_t, shift, root_eps, gate = consts
            y = torch.baddbmm(x * u, torch.bmm(x, down_t), up_t)
            h = torch.addcdiv(shift, y, torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), root_eps))
            x = torch.addcmul(x, mixer(h, ctx, block.index), gate)
    return x


@dataclass
class _RowContext:
    """Per-row conditioning of one loop (0: the output block): each row's budget, and where the operands are kept."""

    loop: int
    ks: tuple[int, ...]
    contexts: dict
    cache: _RowConstants

    def constants(self, norm: nn.RMSNorm, mod: nn.Module) -> Optional[tuple]:
        return self.cache.get(norm, mod, self.loop, self.ks, self.contexts)

    def cond(self) -> Tensor:
        return self.cache.cond(self.loop, self.ks, self.contexts)


def _loop_rows(core: nn.Module, s: Tensor, h_in: Tensor, ctx: LoopContext, rows: Optional[_RowContext]) -> Tensor:
    """:meth:`~elr_lightning.core.RecurrentCore.loop` with a context per row."""
    s_tilde = core.update.inject(s, h_in)
    r = s_tilde
    for block in core.layers_at(ctx.loop):
        r = _block_rows(block, r, ctx, rows)
    return core.update(s, r, s_tilde)


def _output_rows(model: LoopedLM, s: Tensor, ctx: LoopContext, rows: Optional[_RowContext]) -> Tensor:
    for block in model.output_layers:
        s = _block_rows(block, s, ctx, rows)
    return s


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

    def prefix(self, m: int) -> "_Rows":
        """The first ``m`` of these rows, as views of their tables."""
        if m == self.rows.numel():
            return self
        sub = copy.copy(self)
        sub.rows, sub.pos, sub.cos, sub.sin, sub.mask = (t[:m] for t in (self.rows, self.pos, self.cos, self.sin, self.mask))
        sub.view = self.cache.rows(sub.rows, sub.pos[:, None], self.end)
        return sub

    def context(self, loop: int, loops: int, cond: Optional[Tensor] = None) -> LoopContext:
        """A fresh loop context of these rows (its scratch is its own)."""
        return LoopContext(self.positions(), loops, self.model.config.max_loops, loop=loop, cond=cond, cache=self.view)

    def within(self, ctx: LoopContext, loop: int, rows: Optional[Union[slice, Tensor]]) -> LoopContext:
        """The view of ``ctx``'s pass at ``loop`` on these rows, ``rows`` of its batch (``None``: all)."""
        return ctx.on_rows(loop, rows, self.positions(), self.view)

    def positions(self) -> Positions:
        """These rows' positions: one new token each."""
        return Positions(self.cos, self.sin, self.mask, False, None, self.end - 1)

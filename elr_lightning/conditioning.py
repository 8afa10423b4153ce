"""Loop-index and budget conditioning, eq. (4)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from elr_lightning.layers import Modulator, Terms
from elr_lightning.mixers import Modulation
from elr_lightning.plugin_config import RecordsInitArgs
from elr_lightning.recompute import RecomputedTensors, read_dtype
from elr_lightning.roles import set_module_role


class Conditioner(nn.Module, metaclass=RecordsInitArgs):
    """Seam contract for loop conditioning.

    A conditioner owns the context network and builds the per-sublayer :class:`Modulator` s that the
    model places in every recurrent and output layer. Per loop ``i`` of ``k`` (budget ``K``) the
    model asks for a context ``c_i = conditioner(i, k, K, like)``; it passes ``c_k`` to the output
    layers. ``like`` is any tensor of the forward pass, for device and dtype.

    Conditioning can be switched out of the forward pass: while :attr:`active` is False,
    ``forward`` returns ``None`` and the model runs the plain layers.
    :class:`~elr_lightning.callbacks.ZeroInitConditioning` turns it on at the switch with
    :meth:`set_active`. The flag is saved with the weights (buffer ``active_flag``) and mirrored in
    a Python bool, so the forward pass never reads a device tensor (no host sync per loop on GPU).
    Modulators must be zero-initialised so that turning it on changes no output (eq. 4).
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("active_flag", torch.ones((), dtype=torch.bool))
        self._active = True
        self.register_load_state_dict_post_hook(_mirror_active_flag)

    @property
    def active(self) -> bool:
        """Whether conditioning takes part in the forward pass."""
        return self._active

    def reset_buffers(self) -> None:
        """Write the Python mirror into ``active_flag`` (its memory is undefined after ``to_empty``)."""
        self.active_flag.fill_(self._active)

    def set_active(self, active: bool) -> None:
        """Switch conditioning into (``True``) or out of (``False``) the forward pass."""
        self._active = bool(active)
        self.active_flag.fill_(self._active)

    def make_modulator(self, d_model: int) -> Modulator:
        """A fresh modulator for one sublayer of width ``d_model``."""
        raise NotImplementedError

    def context(self, loop: int, loops: int, max_loops: int, like: Tensor) -> Tensor:
        """The context vector c_i for loop ``loop`` of ``loops`` under budget ``max_loops``."""
        raise NotImplementedError

    def forward(self, loop: int, loops: int, max_loops: int, like: Tensor) -> Optional[Tensor]:
        """``context(...)`` while active, else ``None``."""
        if not self._active:
            return None
        return self.context(loop, loops, max_loops, like)


def _mirror_active_flag(module: Conditioner, incompatible_keys: Any) -> None:
    """After a state-dict load, copy the loaded ``active_flag`` into the Python mirror (one read).

    On the meta device (a model built only to check a checkpoint) the flag has no value to read.
    """
    if not module.active_flag.is_meta:
        module._active = bool(module.active_flag)


def _stacked(*weights: Tensor) -> Tensor:
    """The weights' rows one after the other, in the dtype a linear reads them in (:func:`read_dtype`)."""
    return torch.cat(weights).to(read_dtype(weights[0]))


def sinusoid(x: float, freqs: Tensor) -> Tensor:
    """phi(x): ``[sin(f x), cos(f x)]`` over ``freqs``, for a scalar ``x`` in [0, 1]."""
    angles = freqs * x
    return torch.cat((angles.sin(), angles.cos()))


class FiLMAdapterModulator(Modulator):
    """Eq. (4) for one sublayer, with every head zero-initialised.

    ``x~ = (1 + lambda(c)) * RMSNorm(x) + mu(c)``; ``x^ = x~ + A (g(c) * B x~)``;
    ``y = x + (1 + omega(c)) * f(x^)``.

    Args:
        d_model: Width of the sublayer.
        d_cond: Width of the context c.
        rank: Rank r of the adapter A B.
    """

    def __init__(self, d_model: int, d_cond: int, rank: int) -> None:
        super().__init__()
        self.film = nn.Linear(d_cond, 2 * d_model)
        self.g = nn.Linear(d_cond, rank)
        self.omega = nn.Linear(d_cond, d_model)
        self.down = nn.Linear(d_model, rank, bias=False)
        self.up = nn.Linear(rank, d_model, bias=False)
        set_module_role(self, group="conditioning")
        for head in (self.film, self.g, self.omega):
            set_module_role(head, init="zeros")

    def pre(self, h: Tensor, c: Tensor) -> Tensor:
        """Eq. (4): ``x~ = (1 + lambda(c)) * h + mu(c)``, then ``x^ = x~ + A (g(c) * B x~)``."""
        scale, shift = self.film(c).chunk(2, dim=-1)
        h = (1 + scale) * h + shift
        return h + self.up(self.g(c) * self.down(h))

    def post(self, y: Tensor, c: Tensor) -> Tensor:
        """Eq. (4): the exit gate ``(1 + omega(c)) * y``."""
        return (1 + self.omega(c)) * y

    @override
    def modulation(self, c: Tensor) -> tuple[Tensor, Tensor, Modulation]:
        """``pre(h) = P ((1 + lambda) h + mu)`` with ``P = I + A diag(g) B``; the gate ``1 + omega``."""
        scale, shift = self.film(c).chunk(2, dim=-1)
        return 1 + scale, shift, Modulation(self.up.weight * self.g(c), self.down.weight, 1 + self.omega(c))

    @classmethod
    @override
    def modulations(cls, modulators: Sequence["FiLMAdapterModulator"], c: Tensor) -> list[Terms]:
        """:meth:`modulation` of every sublayer at once: all heads ``omega, lambda, mu, g`` (eq. 4) in one matmul.

        The heads' weights and biases are concatenated per call (they change every step), rows
        ``[omega; lambda; mu; g]`` per sublayer, so each sublayer's ``1 + (omega, lambda)`` is one add.
        With gradients on, the backward pass concatenates the weights again rather than keeping a
        copy per loop (:class:`~elr_lightning.recompute.RecomputedTensors`).
        """
        heads = [head for mod in modulators for head in (mod.omega, mod.film, mod.g)]
        with RecomputedTensors(torch.is_grad_enabled() and not torch.compiler.is_compiling()) as keep:
            weight = keep.add(_stacked, *(head.weight for head in heads))
            out = F.linear(c, weight, torch.cat([head.bias for head in heads]))
        sizes = [n for mod in modulators for n in (2 * mod.omega.out_features, mod.omega.out_features, mod.g.out_features)]
        parts = out.split(sizes, dim=-1)
        terms = []
        for j, mod in enumerate(modulators):
            gate, scale = (1 + parts[3 * j]).chunk(2, dim=-1)
            terms.append((scale, parts[3 * j + 1], Modulation(mod.up.weight * parts[3 * j + 2], mod.down.weight, gate)))
        return terms

    def affine(self, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``M = (I + A diag(g) B) diag(1 + lambda)``, ``m = (I + A diag(g) B) mu``, ``gate = 1 + omega``."""
        scale, shift = F.linear(c, self.film.weight.to(c.dtype), self.film.bias.to(c.dtype)).chunk(2, dim=-1)
        g = F.linear(c, self.g.weight.to(c.dtype), self.g.bias.to(c.dtype))
        a, b = self.up.weight.to(c.dtype), self.down.weight.to(c.dtype)
        p = torch.eye(a.shape[0], dtype=c.dtype, device=c.device) + (a * g) @ b
        gate = 1 + F.linear(c, self.omega.weight.to(c.dtype), self.omega.bias.to(c.dtype))
        return p * (1 + scale), p @ shift, gate


BEYOND_BUDGET = ("ratio", "clamp", "replay")
"""What :class:`LoopConditioner` tells loops at k > K: eq. 4's ratio, the budget held at K, or K's loops replayed."""


def loop_steps(loop: int, loops: int, max_loops: int, beyond_budget: str) -> tuple[float, float]:
    """(tau_i, kappa) of eq. 4 for loop ``loop`` of ``loops`` under the budget ``max_loops``.

    Within the budget tau_i = i / k and kappa = k / K; beyond it, as ``beyond_budget`` says
    (:data:`BEYOND_BUDGET`; :class:`LoopConditioner` documents each).
    """
    if loops <= max_loops or beyond_budget == "ratio":
        return loop / loops, loops / max_loops
    if beyond_budget == "clamp":
        return loop / loops, 1.0
    return min(loop, max_loops) / max_loops, 1.0


class LoopConditioner(Conditioner):
    """c_i = MLP([phi(tau_i); phi(kappa)]) with tau_i = i / k and kappa = k / K (eq. 4).

    Beyond the budget (k > K) eq. 4's codes were never trained, and ``beyond_budget`` says what the
    loops are told instead (docs/lab-depth-recipe.md has the experiments):

    - ``"ratio"``: eq. 4 as written. phi's frequencies ``2^j pi`` (:meth:`reset_buffers`) are
      periodic, so phi(k / K) for k in K + 1..2K differs from phi((k - K) / K) only at the lowest
      frequency; the depth quickstart dipped at k = 7 and 10 (K = 6) and recovered at 8, 9, 11, 12.
    - ``"clamp"`` (default): kappa held at 1, so every k > K runs under the budget it was trained at,
      with finer loop steps tau_i = i / k. Root finding holds every k in K + 1..2K within 0.6 points
      of K; prefix parity collapses there (0% at 24 bits from k = 8).
    - ``"replay"``: loop i runs with the context of loop min(i, K) of a K-loop run, so the loops past
      K repeat the last trained loop. Prefix parity stays at or above K's accuracy; root finding
      loses up to 7 points at 2K on the trained depth.

    Args:
        d_cond: Width of the context vector c.
        rank: Rank of each sublayer's low-rank adapter.
        n_freqs: Sinusoid frequencies in phi.
        beyond_budget: ``"ratio"``, ``"clamp"`` or ``"replay"``: the codes of loops at k > K.
    """

    def __init__(self, d_cond: int = 64, rank: int = 8, n_freqs: int = 8, beyond_budget: str = "clamp") -> None:
        super().__init__()
        for name, value in (("d_cond", d_cond), ("rank", rank), ("n_freqs", n_freqs)):
            if value < 1:
                raise ValueError(f"LoopConditioner.{name}={value} must be >= 1")
        if beyond_budget not in BEYOND_BUDGET:
            raise ValueError(f"LoopConditioner.beyond_budget={beyond_budget!r}: choose one of {', '.join(BEYOND_BUDGET)}")
        self.d_cond, self.rank, self.n_freqs, self.beyond_budget = d_cond, rank, n_freqs, beyond_budget
        self.mlp = nn.Sequential(nn.Linear(4 * n_freqs, d_cond), nn.SiLU(), nn.Linear(d_cond, d_cond))
        self.register_buffer("freqs", torch.empty(n_freqs), persistent=False)
        self.reset_buffers()
        set_module_role(self.mlp, group="conditioning")

    @override
    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Also compute the sinusoid frequencies ``2^j pi``, ``j < n_freqs``, in place."""
        super().reset_buffers()
        j = torch.arange(self.n_freqs, dtype=torch.float32, device=self.freqs.device)
        self.freqs.copy_(math.pi * 2.0**j)

    @override
    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "LoopConditioner":
        """``nn.Module``'s, with :attr:`freqs` kept in fp32 where ``fn`` casts it to half precision.

        ``.to(torch.bfloat16)``, and so Lightning's ``bf16-true`` and ``16-true``, cast every floating
        buffer; in bf16, ``2^j pi`` and the angles ``2^j pi x`` lose all but 8 bits, and phi's codes
        came out up to 0.07 off the fp32 codes of inference and of the Hugging Face export.
        """
        super()._apply(fn, recurse)
        if self.freqs.dtype.is_floating_point and torch.finfo(self.freqs.dtype).bits < 32:
            self.freqs = torch.empty(self.n_freqs, dtype=torch.float32, device=self.freqs.device)
            self.reset_buffers()
        return self

    def make_modulator(self, d_model: int) -> Modulator:
        return FiLMAdapterModulator(d_model, self.d_cond, self.rank)

    def steps(self, loop: int, loops: int, max_loops: int) -> tuple[float, float]:
        """(tau_i, kappa) of eq. 4 for loop ``loop`` of ``loops``, as the ``beyond_budget`` argument says past ``max_loops``."""
        return loop_steps(loop, loops, max_loops, self.beyond_budget)

    def context(self, loop: int, loops: int, max_loops: int, like: Tensor) -> Tensor:
        """c_i of eq. 4; phi is computed in fp32 whatever the model's dtype, then cast to the MLP's."""
        tau, kappa = self.steps(loop, loops, max_loops)
        freqs = self.freqs.float()
        phi = torch.cat((sinusoid(tau, freqs), sinusoid(kappa, freqs)))
        return self.mlp(phi.to(self.mlp[0].weight.dtype))

"""State-update rules: how loop i's block output r_i becomes the recurrent state s_i (DESIGN §2)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elr_lightning.plugin_config import RecordsInitArgs
from elr_lightning.roles import set_module_role, set_role


class StateUpdate(nn.Module, metaclass=RecordsInitArgs):
    """Seam contract for a state-update rule.

    The model drives a rule through one forward pass at loop count k as::

        s = rule.init(h_in)                       # s_0
        for i in 1..k:
            s_tilde = rule.inject(s, h_in)        # block input
            r = R_theta(s_tilde)                  # shared layers
            s = rule(s, r, s_tilde)               # s_i

    ``build(d_model)`` is called once by the model before ``init_weights``; rules with parameters
    allocate them there (tag them with :func:`elr_lightning.roles.set_role`). ``metrics()`` returns
    detached scalars about the last forward, logged as ``train/<name>``; a rule must return the same
    keys on every call, so every rank logs the same names.
    """

    def build(self, d_model: int) -> None:
        """Allocate parameters for hidden width ``d_model`` (default: none)."""

    def init(self, h_in: Tensor) -> Tensor:
        """The initial state s_0; ``h_in`` for every rule in the paper."""
        return h_in

    def inject(self, s: Tensor, h_in: Tensor) -> Tensor:
        """The recurrent block's input, s~_i = s_{i-1} + h_in."""
        return s + h_in

    def forward(self, s_prev: Tensor, r: Tensor, s_tilde: Tensor) -> Tensor:
        """The new state s_i from s_{i-1}, r_i and s~_i."""
        raise NotImplementedError

    def metrics(self) -> dict[str, Tensor]:
        """Detached scalars about the last forward (default: none)."""
        return {}


class AdaptiveDelta(StateUpdate):
    """Gated adaptive-delta rule, eq. (2): ``s_i = s_{i-1} + beta_i * (r_i - s_{i-1})``.

    ``beta_i = sigmoid(W s~_i + b) * softplus(gamma)`` per token and channel, with ``W``, ``b`` and
    ``gamma`` shared across loops (d^2 + 2d parameters). ``W`` and ``b`` start at zero; ``gamma``
    starts at ``softplus^-1(2 initial_step)``, so beta starts at ``initial_step`` everywhere. The
    paper's init is ``gamma = 0``: ``sigmoid(0) * softplus(0) = 0.5 ln 2 = 0.3466`` (the default).

    ``injection="mean"`` feeds the block ``s~_i = (s_{i-1} + h_in) / 2`` instead of eq. (2)'s sum:
    the sum adds h_in again at every loop, so the state's RMS grows about linearly in k (the
    quickstart's doubles from loop 1 to 3) and each later loop's pre-norm layers move it relatively
    less; the mean keeps the block input's scale fixed across loops (docs/lab-elastic-depth.md).

    Args:
        initial_step: beta at initialisation, in (0, 1].
        injection: ``sum`` (eq. 2) or ``mean``.
    """

    def __init__(self, initial_step: float = 0.5 * math.log(2.0), injection: str = "sum") -> None:
        super().__init__()
        if not 0.0 < initial_step <= 1.0:
            raise ValueError(f"AdaptiveDelta.initial_step={initial_step} must be in (0, 1]")
        if injection not in ("sum", "mean"):
            raise ValueError(f"AdaptiveDelta.injection={injection!r} must be 'sum' (eq. 2) or 'mean'")
        self.initial_step, self.injection = initial_step, injection

    def inject(self, s: Tensor, h_in: Tensor) -> Tensor:
        """s~_i = s_{i-1} + h_in (eq. 2), or their mean with ``injection="mean"``."""
        return s + h_in if self.injection == "sum" else torch.lerp(s, h_in, 0.5)

    def build(self, d_model: int) -> None:
        self.gate = nn.Linear(d_model, d_model)
        self.gamma = nn.Parameter(torch.zeros(d_model))
        set_module_role(self.gate, init="zeros", group="gate")
        set_role(self.gamma, init="module", group="gate")
        self.register_buffer("_beta_mean", torch.zeros(()), persistent=False)

    @torch.no_grad()
    def init_parameter(self, name: str, param: Tensor) -> None:
        """``gamma = softplus^-1(2 initial_step) = log(expm1(2 initial_step))`` (``init="module"``)."""
        param.fill_(math.log(math.expm1(2.0 * self.initial_step)))

    def reset_buffers(self) -> None:
        """Zero the ``beta_mean`` scratch (its memory is undefined after ``to_empty``)."""
        self._beta_mean.zero_()

    def beta(self, s_tilde: Tensor) -> Tensor:
        """The step size beta_i of eq. (2)."""
        return torch.sigmoid(self.gate(s_tilde)) * F.softplus(self.gamma)

    def forward(self, s_prev: Tensor, r: Tensor, s_tilde: Tensor) -> Tensor:
        beta = self.beta(s_tilde)
        if self.training and not torch.compiler.is_compiling():  # a side effect a checkpointed graph refuses
            self._beta_mean = beta.detach().float().mean()
        return torch.lerp(s_prev, r.to(s_prev.dtype), beta.to(s_prev.dtype))  # s + beta (r - s), one op

    def metrics(self) -> dict[str, Tensor]:
        """``beta_mean``: mean step size of the last eager training forward (not kept under ``torch.compile``)."""
        return {"beta_mean": self._beta_mean}


class FixedDelta(StateUpdate):
    """Delta rule with a constant step size (ablation): ``s_i = s_{i-1} + beta (r_i - s_{i-1})``.

    Args:
        beta: The step size, in (0, 1].
    """

    def __init__(self, beta: float = 0.5) -> None:
        super().__init__()
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"FixedDelta.beta={beta} must be in (0, 1]")
        self.beta = beta

    def forward(self, s_prev: Tensor, r: Tensor, s_tilde: Tensor) -> Tensor:
        return s_prev + self.beta * (r - s_prev)

    def metrics(self) -> dict[str, Tensor]:
        return {"beta_mean": torch.tensor(self.beta)}


class Residual(StateUpdate):
    """Residual rule (ablation): the state accumulates the block's increment, ``s_i = s_{i-1} + (r_i - s~_i)``."""

    def forward(self, s_prev: Tensor, r: Tensor, s_tilde: Tensor) -> Tensor:
        return s_prev + (r - s_tilde)


class Replace(StateUpdate):
    """Replace rule (ablation, as in Huginn-style models): ``s_i = r_i``."""

    def forward(self, s_prev: Tensor, r: Tensor, s_tilde: Tensor) -> Tensor:
        return r


class NonRecurrent(StateUpdate):
    """The non-recurrent baseline: no injection and no update, so one pass is a plain transformer.

    With ``loops=1`` the model computes ``O(R(I(x)))``: the same layers, parameters and FLOPs as
    an ELR model at k = 1, minus the adaptive-delta gate. Use it with ``FixedLoops(1)``.
    """

    def inject(self, s: Tensor, h_in: Tensor) -> Tensor:
        return s

    def forward(self, s_prev: Tensor, r: Tensor, s_tilde: Tensor) -> Tensor:
        return r


#: beta at initialisation for :class:`AdaptiveDelta`: sigmoid(0) * softplus(0) = 0.5 ln 2.
BETA_INIT = 0.5 * math.log(2.0)

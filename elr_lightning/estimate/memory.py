"""Per-rank peak memory of one training step, measured on fake tensors: no model is allocated.

The model is built on the meta device, sharded as the run's strategy shards it (FSDP2's
``fully_shard`` over a fake process group, :func:`~elr_lightning.strategies.shard_looped_lm`), and
given fake storage (``FakeTensorMode`` and ``to_empty``, so parameters stay leaves, as torchtitan's
memory estimation does). One training step then runs on the fake tensors exactly as
:meth:`~elr_lightning.module.ELRModule.training_step` runs it (the micro-batch's shards forward at
their k, auxiliary losses, backward, gradient clipping, AdamW, ``zero_grad``) under torch's
``MemTracker`` (``FSDPMemTracker`` under FSDP2), which sees every tensor the step creates and frees.
Its peak is the estimate: whatever the model does (eq. 4's terms, the per-loop stores, activation
checkpointing's recomputation) is measured, not modelled.

Not traced, hence not counted: the CUDA context, the caching allocator's fragmentation and reserve,
NCCL's buffers, and on the CPU what the C allocator keeps of freed memory (the headroom of
``elr estimate`` and ``elr fit`` holds memory back for them). Two pieces of a GPU run cannot run on
fake tensors and are stood in for by hand: fla's Triton kernels of the GDP layers
(:mod:`elr_lightning.estimate.fla` allocates what they allocate, with ``Target(fla_kernels=True)``,
which :func:`gdp_path` decides as the GDP layers do at run time; else the layers run the PyTorch
chunked path), and torch's DDP reducer (it reads parameter data), whose gradient buckets are added
as one gradient-sized buffer per rank (the gradients live in them with ``gradient_as_bucket_view``).
Gradient accumulation is traced (two micro-batches, the gradients of the first alive through the
second); ``compile_model`` is not: the eager step is traced, and a compiled step keeps what the
compiler's partitioner chooses.
``elr estimate`` (:mod:`elr_lightning.estimate.report`) prints the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._tools.mem_tracker import MemTracker, _RefType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elr_lightning.core import CHECKPOINTING
from elr_lightning.estimate.fla import fla_stand_in
from elr_lightning.estimate.replay import LayerReplay
from elr_lightning.estimate.trackers import _GRADS, _HOST, _OPTIMIZER, _PARAMS, FSDPStepTracker, StepTracker
from elr_lightning.mixers.delta_rule import FLA_STAND_IN, _fla_kernel
from elr_lightning.module import ELRModule
from elr_lightning.optim import adamw, param_groups
from elr_lightning.strategies.fsdp import RECURRENT_UNITS, mixed_precision_policy, shard_looped_lm

#: How the step is distributed: one device, DDP (a full replica per rank) or FSDP2 (sharded over all ranks).
STRATEGIES = ("single", "ddp", "fsdp")

#: Lightning precisions: ``(autocast dtype, parameter dtype)``.
PRECISIONS: dict[str, tuple[Optional[torch.dtype], torch.dtype]] = {
    "32-true": (None, torch.float32),
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "16-mixed": (torch.float16, torch.float32),
    "bf16-true": (None, torch.bfloat16),
}

#: Fraction of the CPU's memory that ``elr estimate`` holds back for what the trace does not see, for a run on the CPU.
#: That is mostly what the C allocator keeps of freed memory: with glibc's default thresholds a real run's resident
#: set reached 1/0.79 = 1.27x the traced peak (``elr fit`` on a hybrid config the estimate had not been tuned on, in
#: the code audit of issue 40), against 1.06x with ``MALLOC_MMAP_THRESHOLD_=65536``; ``bench/estimate.py --allocator
#: default`` measures the step alone (0.45-0.88x, the lower where the step is small; docs/memory.md). A quarter held
#: back keeps a traced peak within the budget at no more than 0.75 / 0.79 = 95% of the memory there. The host memory
#: of an offloaded run is CPU memory too, and is held to the same fraction.
CPU_HEADROOM = 0.25

#: Fraction of an accelerator's memory held back, for a run on a GPU: 8 GB of 80. No CPU allocator is involved:
#: tensors come from torch's caching allocator, whose blocks the trace counts at their tensors' sizes. What the
#: trace does not see is the CUDA context and the kernels' modules (about 0.5 GB with lazy loading), cuBLAS's
#: workspaces (tens of MiB), NCCL's buffers (some hundreds of MiB per communicator) and the caching allocator's
#: reserve above what is allocated (rounding to its block sizes and fragmentation; ``expandable_segments`` lowers
#: it). These are priors, not measured here (no GPU was lent to this work): compare the estimate ``elr fit`` logs
#: with ``torch.cuda.max_memory_reserved()`` of the first steps, and set ``--headroom`` from that ratio.
ACCELERATOR_HEADROOM = 0.10


def default_headroom(device_type: str) -> tuple[float, str]:
    """The fraction of a device's memory ``elr estimate`` and ``elr fit`` hold back by default, and why in words.

    :data:`CPU_HEADROOM` on the CPU (what glibc keeps of freed memory), :data:`ACCELERATOR_HEADROOM`
    on any accelerator (its context, communication buffers and caching allocator's reserve).

    Args:
        device_type: ``cpu``, ``cuda``, ...
    """
    if device_type == "cpu":
        return CPU_HEADROOM, "the default for CPU RAM: what glibc keeps of freed memory, up to 1.27x the traced peak"
    return ACCELERATOR_HEADROOM, (
        f"the default for a {device_type} device: its context, NCCL's buffers and the caching allocator's reserve"
    )



def half_precision(precision: str) -> bool:
    """Whether a precision computes in bf16 or fp16 (where fla's kernels run)."""
    autocast, params = PRECISIONS[precision]
    return (autocast or params) in (torch.bfloat16, torch.float16)


def gdp_path(precision: str, device_type: str) -> tuple[bool, str]:
    """Whether a run's GDP layers run fla's kernels, by the test they apply at run time, and the path in words.

    :func:`~elr_lightning.mixers.delta_rule.delta_product` runs fla's kernels where the tensors are on
    CUDA in bf16 or fp16 and fla imports; else the PyTorch chunked path. ``elr fit`` asks this of its
    own device, ``elr estimate`` of the device the config's ``trainer.accelerator`` gives here.

    Args:
        precision: A key of :data:`PRECISIONS`.
        device_type: ``cuda``, ``cpu``, ...
    """
    if not half_precision(precision):
        return False, f"the PyTorch chunked path ({precision}: fla's kernels need bf16 or fp16)"
    if device_type != "cuda":
        return False, f"the PyTorch chunked path (on {device_type}: fla's kernels run on CUDA only)"
    if _fla_kernel() is None:
        return False, "the PyTorch chunked path (fla does not import here)"
    return True, "fla's kernels (CUDA, half precision, fla imports)"


def has_gdp_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds Gated DeltaProduct layers (whose memory depends on :func:`gdp_path`)."""
    from elr_lightning.mixers import GatedDeltaProduct

    return any(isinstance(m, GatedDeltaProduct) for m in model.modules())


def lightning_precision(precision: Any) -> str:
    """A Lightning ``trainer.precision`` (``32``, ``"bf16"``, ``"bf16-mixed"``, ...) as a key of :data:`PRECISIONS`.

    Raises:
        ValueError: A precision the estimate does not cover, naming the field.
    """
    name = str(precision)
    name = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(name, name)
    if name not in PRECISIONS:
        raise ValueError(
            f"trainer.precision={precision!r}: the memory estimate covers {', '.join(PRECISIONS)}; "
            "estimate with one of them"
        )
    return name


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the step runs, as the trainer runs it.

    Attributes:
        strategy: One of :data:`STRATEGIES`.
        world_size: Ranks in all (devices x nodes); FSDP2 shards over all of them.
        precision: A key of :data:`PRECISIONS`.
        gradient_clip_val: ``trainer.gradient_clip_val`` (the step clips the gradients' norm when set).
        gradient_as_bucket_view: DDP's option: the gradients live in its buckets instead of beside them.
        reshard_after_forward: FSDP2's option (:func:`~elr_lightning.strategies.shard_looped_lm`).
        cpu_offload: FSDP2's CPU offload (:func:`~elr_lightning.strategies.shard_looped_lm`): the shards,
            their gradients and the optimizer's state are the host's, the rest the device's
            (:class:`StepMemory`).
        accelerator: The device type the run trains on (``cpu``, ``cuda``, ...). On an accelerator an
            offloaded run pins its host shards and gradient shards, in blocks rounded up to a power
            of two (torch's pinned-memory allocator), which :attr:`StepMemory.host` counts.
        fla_kernels: The GDP layers run fla's kernels, as on a CUDA device with fla installed and
            half-precision activations (traced with :func:`~elr_lightning.estimate.fla.fla_stand_in`);
            else the PyTorch chunked path (:func:`gdp_path` decides it as a run does).
        recurrent_units: FSDP2's units of the recurrent block, ``layer`` or ``core``
            (:func:`~elr_lightning.strategies.shard_looped_lm`).
        accumulate_grad_batches: Micro-batches per optimizer step; above 1 the step traces two, so the
            first one's gradients are alive through the second's forward and backward passes.
    """

    strategy: str = "single"
    world_size: int = 1
    precision: str = "32-true"
    gradient_clip_val: Optional[float] = None
    gradient_as_bucket_view: bool = False
    reshard_after_forward: bool = True
    fla_kernels: bool = False
    recurrent_units: str = "layer"
    accumulate_grad_batches: int = 1
    cpu_offload: bool = False
    accelerator: str = "cpu"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} must be one of {STRATEGIES}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be an integer >= 1 (devices x nodes)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {tuple(PRECISIONS)} (see lightning_precision)")
        if self.recurrent_units not in RECURRENT_UNITS:
            raise ValueError(f"recurrent_units={self.recurrent_units!r} must be one of {', '.join(RECURRENT_UNITS)}")
        accumulate = self.accumulate_grad_batches
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate_grad_batches={accumulate!r} must be an integer >= 1")
        if self.cpu_offload and self.strategy != "fsdp":
            raise ValueError(f"cpu_offload is FSDP2's (strategy 'fsdp'); strategy={self.strategy!r} has none")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One training step to estimate: every local shard runs ``loops`` under one backward setting.

    Attributes:
        loops: The loop count k of every shard of this rank's micro-batch (the step's worst case
            when k is the largest the sampler draws).
        checkpointing: ``activation_checkpointing`` (one of ``none``, ``loop``, ``layer``).
        backprop_loops: Truncated backpropagation through the last n loops; ``None``: all.
        micro_batch: Sequences per rank per step (``data.batch_size``), split into ``virtual_ranks`` shards.
        seq_len: Tokens per sequence (``data.seq_len``).
    """

    loops: int
    checkpointing: str = "none"
    backprop_loops: Optional[int] = None
    micro_batch: int = 1
    seq_len: int = 256

    def __post_init__(self) -> None:
        for name in ("loops", "micro_batch", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing={self.checkpointing!r} must be one of {CHECKPOINTING}")

    @property
    def label(self) -> str:
        """``none``, ``loop`` or ``layer``, with ``+bp{n}`` for truncated backpropagation (``bp1`` alone for ``none``)."""
        if self.backprop_loops is None:
            return self.checkpointing
        return f"bp{self.backprop_loops}" if self.checkpointing == "none" else f"{self.checkpointing}+bp{self.backprop_loops}"


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What is alive on one rank's device at the peak of a training step, in bytes; the columns sum to
    :attr:`peak`, and :attr:`host` is what the rank keeps in host memory.

    Under FSDP2's CPU offload (``Target(cpu_offload=True)``) the device holds the gathered units,
    the unsharded gradients with their collectives' buffers, the activations and the batch; the
    shards, their gradients, the optimizer's state and the update's temporaries (clipping and the
    optimizer step run on the host) are :attr:`host`'s. Each is the peak of its own memory, which may
    come at different moments of the step.

    Attributes:
        params: Parameters (FSDP2: the rank's shards, unless offloaded, plus the gathered units alive
            at the peak; offloaded, also one unit's shards copied to the device for its all-gather,
            which the trace on the CPU does not see).
        grads: Gradients, DDP's gradient buckets and FSDP2's reduce-scatter buffers.
        optimizer: AdamW's state (0 when offloaded).
        activations: Activations saved for the backward pass, temporaries, buffers and the batch.
        host: Host memory of the step's offloaded state at its peak (0 without offload), with the
            power-of-two rounding of pinned memory where the run pins it.
        sharded: The part of the columns that FSDP2 shards over the ranks (parameter and gradient
            shards, AdamW's state; 0 otherwise), which shrinks as 1 / ranks on more of them: what
            the verdict of ``elr estimate`` scales to find the smallest node count that fits. Not a
            column: it is counted in the others.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    host: int = 0
    sharded: int = 0

    @property
    def peak(self) -> int:
        """The peak, the sum of the columns."""
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int]:
        """The columns and the peak, in bytes."""
        return {**dataclasses.asdict(self), "peak": self.peak}



class TrainingStep(nn.Module):
    """The loss of one micro-batch as :meth:`ELRModule.training_step` computes it, as one module call.

    Lightning calls the training step once per micro-batch through DDP's wrapper; the trackers need
    that one root call too, while the module runs its model once per shard.
    """

    def __init__(self, module: ELRModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Tensor, loops: list[int]) -> Tensor:
        """``shard_loss`` of ``batch`` with shards at ``loops``, plus the mixers' auxiliary losses."""
        aux: dict[str, Tensor] = {}
        loss = self.module.shard_loss(batch, loops, aux, {})
        return loss + sum(aux.values(), start=torch.zeros_like(loss))


def primed_optimizer(module: ELRModule, gradient_clip_val: Optional[float] = None) -> torch.optim.Optimizer:
    """The module's AdamW (its groups, learning rates and fused kernel) holding state for every trainable parameter.

    The state is made by one step on zero gradients (clipped first when ``gradient_clip_val`` is
    set), so a traced step sees it as a run does from its second step on (after the delayed switch
    every parameter has state). Under FSDP2 this also runs each of the step's operations on the
    sharded parameters once before any tracing: DTensor derives an operation's output layout the
    first time it meets it by running it on fake tensors of the global (unsharded) shapes, in the
    active ``FakeTensorMode``, where a tracker would count them (clipping 8 shards would count as
    8 full copies of the gradients); later calls reuse the layout.
    """
    hp = module.hparams
    model = module.model
    optimizer = adamw(param_groups(model, hp.weight_decay, hp.lr, hp.get("lr_scale")), lr=hp.lr, betas=tuple(hp.betas))
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    if gradient_clip_val:
        torch.nn.utils.clip_grad_norm_(model.parameters(), gradient_clip_val)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def ddp_bucket_bytes(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets for ``model``: one buffer the size of every trainable parameter's gradient."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def step_batch(module: ELRModule, setting: Setting) -> Tensor:
    """Random token ids ``[micro_batch, seq_len + 1]`` on the model's device (fake under ``FakeTensorMode``)."""
    param = next(module.model.parameters())
    device = param.to_local().device if hasattr(param, "to_local") else param.device
    return torch.randint(0, module.arch.vocab_size, (setting.micro_batch, setting.seq_len + 1), device=device)


def training_step(
    module: ELRModule,
    optimizer: torch.optim.Optimizer,
    target: Target,
    setting: Setting,
    batch: Tensor,
    before_update: Optional[Callable[[], None]] = None,
    micro_batches: Optional[int] = None,
) -> None:
    """One optimizer step of ``module`` on ``batch`` as Lightning runs it: the loss under the precision's autocast,
    backward, gradient clipping, ``optimizer.step()``, ``zero_grad(set_to_none=True)``.

    Every local shard runs ``setting.loops`` under ``setting``'s backward setting (set on the model).
    With gradient accumulation two micro-batches run before the optimizer step (the memory of any
    later one is the second's), or ``micro_batches`` of them. ``before_update`` is called after the
    last backward pass, before clipping.
    """
    model = module.model
    model.set_backprop(setting.checkpointing, setting.backprop_loops)
    autocast_dtype, _ = PRECISIONS[target.precision]
    for _ in range(min(target.accumulate_grad_batches, 2) if micro_batches is None else micro_batches):
        autocast = (
            torch.autocast(batch.device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
        )
        with autocast:
            loss = TrainingStep(module)(batch, [setting.loops] * module.virtual_ranks)
        loss.backward()
        del loss
    if before_update is not None:
        before_update()
    if target.gradient_clip_val:
        torch.nn.utils.clip_grad_norm_(model.parameters(), target.gradient_clip_val)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for layer in module.all_layers():
        layer.mlp.discard_step()


def traced_phases(
    module: ELRModule,
    optimizer: torch.optim.Optimizer,
    target: Target,
    setting: Setting,
    prior_grads: bool = False,
    replay: Optional[LayerReplay] = None,
) -> dict[str, StepMemory]:
    """:func:`training_step` of ``module`` (fake or real tensors) under the tracker of ``target``; the peak of each
    of its phases: ``step`` (forward and backward passes) and ``update`` (clipping, the optimizer step).

    The module's model must already be in the state the strategy gives it (sharded for FSDP2, on
    the step's device); ``optimizer`` from :func:`primed_optimizer`. :func:`step_peak` of the result is
    the step's peak.

    With ``prior_grads`` and gradient accumulation, the first micro-batch is not run: every trainable
    parameter is given the gradient it leaves (:func:`accumulated_grads`, before the tracker starts, so
    the tracker files them as gradients, sharded under FSDP2 and in host memory under its offload), and
    one micro-batch is traced. That micro-batch is the step's second: what is alive at each of its
    moments is what was alive at the same moment of the first plus the gradients, so the step's peak
    is the same, at half the tracing.

    With ``replay`` the layers' calls are replayed from one traced call of each kind
    (:mod:`elr_lightning.estimate.replay`).
    """
    model = module.model
    batch = step_batch(module, setting)
    micro_batches = None
    if prior_grads and target.accumulate_grad_batches > 1:
        accumulated_grads(model)
        micro_batches = 1
    if target.strategy == "fsdp":
        tracker: MemTracker = FSDPStepTracker(model, optimizer)
        tracker.track_inputs((batch,))
    else:
        tracker = StepTracker()
        tracker.track_external(model, optimizer, batch)
    tracker.offloaded = target.cpu_offload

    def updating() -> None:
        tracker.updating = True

    with tracker, warnings.catch_warnings():
        # torch's module tracker notes the modules it cannot see in the backward pass (a mixer called through
        # functional_call); the peak does not depend on them
        warnings.filterwarnings("ignore", message=r"Module is None\. Skipping")
        replaying = replay.installed(module.all_layers(), tracker.probe) if replay else contextlib.nullcontext()
        with replaying:
            training_step(module, optimizer, target, setting, batch, before_update=updating, micro_batches=micro_batches)
    phases = {}
    for phase, snapshots in tracker.phase_peaks.items():
        memory = _columns(snapshots.get(batch.device, {}))
        if target.cpu_offload:
            pinned = target.accelerator != "cpu"
            memory = dataclasses.replace(
                memory,
                params=memory.params + offload_copy_bytes(model),
                host=tracker.phase_host.get(phase, 0) + (pinned_rounding_bytes(model) if pinned else 0),
            )
        if target.strategy == "ddp":
            buckets = ddp_bucket_bytes(model)
            grads = buckets if target.gradient_as_bucket_view else memory.grads + buckets
            memory = dataclasses.replace(memory, grads=grads)
        phases[phase] = memory
    return phases


def accumulated_grads(model: nn.Module) -> None:
    """Give every trainable parameter of ``model`` that has none the gradient that a micro-batch's backward pass
    leaves it under gradient accumulation: one of its own shape, placement and dtype (a sharded one under FSDP2)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def step_peak(phases: dict[str, StepMemory]) -> StepMemory:
    """The step's peak from its phases' (:func:`traced_phases`): the columns of the phase with the highest peak (the
    first of equal ones), and the largest host memory of any phase."""
    top = max(phases.values(), key=lambda memory: memory.peak)
    return dataclasses.replace(top, host=max(memory.host for memory in phases.values()))


def traced_step(
    module: ELRModule,
    optimizer: torch.optim.Optimizer,
    target: Target,
    setting: Setting,
    prior_grads: bool = False,
    replay: Optional[LayerReplay] = None,
) -> StepMemory:
    """:func:`training_step` of ``module`` (fake or real tensors) under the tracker of ``target``; its peak
    (:func:`step_peak` of :func:`traced_phases`)."""
    return step_peak(traced_phases(module, optimizer, target, setting, prior_grads, replay))


def _fsdp_params(model: nn.Module) -> list[list[Any]]:
    """FSDP2's per-parameter records (``FSDPParam``) of each unit of ``model``."""
    units = []
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        if group is not None:
            units.append(list(group.fsdp_params))
    return units


def offload_copy_bytes(model: nn.Module) -> int:
    """Device bytes an offloaded all-gather adds that a trace on the CPU does not see: the largest unit's shards.

    Under CPU offload FSDP2 copies a unit's shards from the host to the device before it casts them
    and gathers (``FSDPParam.all_gather_inputs``); on a CPU mesh that copy is the shard itself. At
    most a unit's shards are alive at once (with mixed precision each is freed once cast).
    """
    sizes = [sum(p._sharded_param_data.numel() * p._sharded_param_data.element_size() for p in unit) for unit in _fsdp_params(model)]
    return max(sizes, default=0)


def _power_of_two_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def pinned_rounding_bytes(model: nn.Module) -> int:
    """Host bytes that pinning adds to an offloaded rank's shards and gradient shards, which the trace does not see.

    On an accelerator FSDP2 pins each parameter's shard (``pin_memory()``) and copies each gradient
    shard to pinned memory; torch's pinned-memory allocator (``CachingHostAllocator``) rounds every
    block up to the next power of two. Optimizer state is allocated like its parameter but not
    pinned (``zeros_like``), so it is not rounded.
    """
    extra = 0
    for unit in _fsdp_params(model):
        for p in unit:
            element = p._sharded_param_data.element_size()
            shard = p._sharded_param_data.numel() * element
            grad = math.prod(p.sharded_size) * element
            extra += _power_of_two_ceil(shard) - shard + _power_of_two_ceil(grad) - grad
    return extra


def _columns(snapshot: dict[Any, int]) -> StepMemory:
    kinds = {kind: n for kind, n in snapshot.items() if isinstance(kind, _RefType)}
    params = sum(n for kind, n in kinds.items() if kind in _PARAMS)
    grads = sum(n for kind, n in kinds.items() if kind in _GRADS)
    optimizer = sum(n for kind, n in kinds.items() if kind in _OPTIMIZER)
    sharded = sum(n for kind, n in kinds.items() if kind in _HOST)
    return StepMemory(params, grads, optimizer, sum(kinds.values()) - params - grads - optimizer, sharded=sharded)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[DeviceMesh]:
    """A fake default process group of ``world_size`` ranks (this process is rank 0) and its 1-D mesh.

    No rank talks to another: collectives return buffers of the right shape (torch's ``fake``
    backend). The group is destroyed on exit.

    Raises:
        RuntimeError: A process group exists already (the estimate needs its own; run it before
            ``torch.distributed`` is initialised).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError(
            "the memory estimate needs a fake process group of its own, but torch.distributed is initialised "
            "already; run the estimate before the run's process group starts"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_training(
    build: Callable[[], ELRModule], target: Target, phases: bool = False, prior_grads: bool = False, replay: bool = False
) -> Iterator[Callable[[Setting], Any]]:
    """A model of ``build`` on fake tensors, placed as ``target``'s strategy places it; yields ``step(setting)``.

    ``step`` traces one training step (:func:`traced_step`) and returns its per-rank peak (with
    ``phases``, the peak of each phase, :func:`traced_phases`); call it for as many settings as
    needed, all on the one fake model. ``step.layer_replay`` is the
    :class:`~elr_lightning.estimate.replay.LayerReplay` of its steps (``None`` without ``replay``). Nothing is allocated but the fake
    tensors' metadata, and the global random state is left as it was.

    Args:
        build: Returns the :class:`ELRModule` to estimate, built on the meta device (called once).
        target: Strategy, ranks and precision of the run.
        phases: ``step`` returns the peak of each phase (:func:`traced_phases`) instead of the step's.
        prior_grads: Under gradient accumulation, trace one micro-batch after the gradients the first
            leaves instead of two (:func:`traced_phases`).
        replay: Replay the layers' calls from one traced call of each kind, measured once for all the steps
            (:mod:`elr_lightning.estimate.replay`).

    Raises:
        ValueError: ``build`` returned a module whose parameters are not on the meta device.
    """
    _, param_dtype = PRECISIONS[target.precision]
    mesh_context = fake_process_group(target.world_size) if target.strategy == "fsdp" else contextlib.nullcontext()
    stand_in = FLA_STAND_IN.set(fla_stand_in if target.fla_kernels else None)
    try:
        with mesh_context as mesh, torch.random.fork_rng(devices=[]):
            yield from _fake_steps(build, target, mesh, param_dtype, phases, prior_grads, replay)
    finally:
        FLA_STAND_IN.reset(stand_in)


def _fake_steps(
    build: Callable[[], ELRModule],
    target: Target,
    mesh: Optional[DeviceMesh],
    param_dtype: torch.dtype,
    phases: bool,
    prior_grads: bool,
    replay: bool,
) -> Iterator[Callable[[Setting], Any]]:
    module = build()
    model = module.model
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("the memory estimate needs a module built on the meta device (under torch.device('meta'))")
    model.to(param_dtype)
    if target.strategy == "fsdp":
        # on the meta device, before the fake mode: FSDP2 cuts every parameter into one chunk per rank, which meta
        # tensors do in C++ and fake tensors one Python object per chunk (most of the setup's time at 128 ranks)
        policy = mixed_precision_policy(target.precision)
        shard_looped_lm(
            model, mesh, reshard_after_forward=target.reshard_after_forward, mp_policy=policy,
            recurrent_units=target.recurrent_units, cpu_offload=target.cpu_offload,
        )
    with fake_mode():
        model.to_empty(device="cpu")
        model.train()
        optimizer = primed_optimizer(module, target.gradient_clip_val)
        trace = traced_phases if phases else traced_step
        layers = LayerReplay() if replay else None

        def step(setting: Setting) -> Any:
            return trace(module, optimizer, target, setting, prior_grads, layers)

        step.layer_replay = layers  # type: ignore[attr-defined]  # what was replayed, for tests and the bench
        yield step


def estimate_steps(build: Callable[[], ELRModule], target: Target, settings: Sequence[Setting]) -> list[StepMemory]:
    """The per-rank peak of one training step at each of ``settings``, without allocating the model
    (:func:`fake_training`)."""
    with fake_training(build, target) as step:
        return [step(setting) for setting in settings]


def fake_mode() -> contextlib.AbstractContextManager:
    """The estimate's ``FakeTensorMode``: meta parameters from outside it become fake leaves under ``to_empty``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def measured_steps(module: ELRModule, target: Target, settings: Sequence[Setting]) -> list[StepMemory]:
    """The same steps as :func:`estimate_steps` on a real module of this process (CPU, one rank), each traced by
    ``MemTracker`` on real tensors: what the estimate is checked against.

    ``target.strategy`` must be ``single`` or ``ddp`` (the DDP term is added as in the estimate).
    """
    if target.strategy == "fsdp":
        raise ValueError("measured_steps runs one rank without sharding: use strategy 'single' or 'ddp'")
    _, param_dtype = PRECISIONS[target.precision]
    module.model.to(param_dtype).train()
    optimizer = primed_optimizer(module, target.gradient_clip_val)
    return [traced_step(module, optimizer, target, setting) for setting in settings]


__all__ = [
    "ACCELERATOR_HEADROOM",
    "CPU_HEADROOM",
    "PRECISIONS",
    "STRATEGIES",
    "Setting",
    "StepMemory",
    "Target",
    "TrainingStep",
    "accumulated_grads",
    "ddp_bucket_bytes",
    "default_headroom",
    "estimate_steps",
    "fake_mode",
    "fake_process_group",
    "fake_training",
    "gdp_path",
    "half_precision",
    "has_gdp_layers",
    "lightning_precision",
    "measured_steps",
    "offload_copy_bytes",
    "pinned_rounding_bytes",
    "primed_optimizer",
    "step_batch",
    "step_peak",
    "traced_phases",
    "traced_step",
    "training_step",
]


"""One rank of a multi-process strategy test: ``python tests/_dist_worker.py SPEC.json``.

The test launches one process per rank with ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
``NODE_RANK`` and ``LOCAL_RANK`` set (Lightning then joins them instead of spawning), or starts it
under ``torchrun`` (one agent per "node"), and the same spec. Each case of the spec trains a tiny looped LM for a few steps and writes, from every rank,
``<out>/<case>.rank<r>.pt``: the full model state and the loop counts that rank ran per step.
:func:`train_case` also serves the single-process reference, called from the test process.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
from unittest import mock
from collections import Counter, defaultdict
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from typing_extensions import override

from elr_lightning.batches import IGNORE_INDEX
from elr_lightning.callbacks import DelayedMixedDepth, ZeroInitConditioning
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.data import TextDataModule
from elr_lightning.model import LoopedLM
from elr_lightning.module import ELRModule
from elr_lightning.sampling import OneLoopOverride
from elr_lightning.strategies import OneLoopOverrideDDPStrategy, OneLoopOverrideFSDPStrategy

#: The backend of ``compile_model`` cases: AOTAutograd's graphs with inductor's decompositions, run
#: without code generation, so a compiled run costs seconds of tracing rather than minutes of C++ builds.
COMPILE_BACKEND = "aot_eager_decomp_partition"

#: Collective timeout of every test strategy: a hang fails in seconds.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)


class RecordEvaluationModes(Callback):
    """Keeps ``[stage, sanity checking, inference mode on]`` at every validation batch this rank runs."""

    def __init__(self) -> None:
        self.modes: list[list[Any]] = []

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.modes.append([trainer.state.fn.value, trainer.sanity_checking, torch.is_inference_mode_enabled()])


def evaluation_as_on_nccl() -> Any:
    """Lightning's choice of evaluation context as on NCCL: its loops use ``torch.no_grad`` instead of
    ``torch.inference_mode`` on a gloo process group only (``_no_grad_context``); this hides the group from
    that check, so ``inference_mode`` is chosen wherever a loop and the strategy allow it."""
    import lightning.pytorch.loops.utilities as loop_utilities

    return mock.patch.object(loop_utilities, "_distributed_is_initialized", lambda: False)


class RecordLoops(Callback):
    """Keeps ``[optimizer step, loop counts]`` and the loss of every micro-batch this rank runs, and
    the model's state (gathered) and the optimizer's groups at the start of training, and the dtypes
    the forward saw in training (:func:`probe_forward_dtypes`)."""

    def __init__(self, dtypes: dict[str, set[str]]) -> None:
        self.dtypes = dtypes  # filled by probe_forward_dtypes' hooks
        self.loops: list[list[Any]] = []
        self.expert_loads: list[list[list[float]]] = []
        self.losses: list[float] = []
        self.utilisation: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}
        self.groups: dict[str, dict[str, Any]] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.dtypes.clear()  # what the strategies' setup probes ran (unsharded, without autocast) is not training
        self.initial = full_state(pl_module)
        names = {id(p): name for name, p in pl_module.model.named_parameters()}
        self.groups = {
            g["name"]: {"weight_decay": g["weight_decay"], "params": sorted(names[id(p)] for p in g["params"])}
            for g in trainer.optimizers[0].param_groups
        }

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.loops.append([trainer.global_step, pl_module.local_loops()])

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        """This rank's own expert load per MoE layer in the step (before the module sums it over ranks)."""
        loads = [getattr(layer.mlp, "_load", None) for layer in pl_module.all_layers()]
        self.expert_loads.append([load.tolist() for load in loads if load is not None])

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.utilisation.append(float(trainer.callback_metrics["train/rank_utilisation"]))


class SimulatedRanks(ELRModule):
    """One process standing in for :attr:`ranks` data-parallel ranks: micro-batch m of each optimizer step
    (of ``accumulate_grad_batches = ranks x accumulate``, ordered micro-batch-major) runs rank m's shards at rank
    m's loop counts.

    With ``batch_size`` B per micro-batch, micro-batch m of step t reads the rows rank m reads at step
    t (:class:`~elr_lightning.data.StepIndexedLoader`), and gradient accumulation sums the micro-batches'
    gradients, each computed alone, as the all-reduce sums the ranks'. So it is the reference that a
    multi-process run equals bit for bit where the reduction adds the ranks' gradients in rank order
    (two ranks: one addition, which commutes).
    """

    ranks = 1

    def _position(self) -> int:
        """This micro-batch's index among the ``accumulate_grad_batches`` (ranks x the run's) of its step."""
        fit_loop = getattr(self._trainer, "fit_loop", None)
        total = int(getattr(self._trainer, "accumulate_grad_batches", 1))
        return 0 if fit_loop is None else max(fit_loop.epoch_loop.batch_progress.current.ready - 1, 0) % total

    @override
    def data_parallel_layout(self) -> tuple[int, int]:
        return self._position() % self.ranks, self.ranks

    @override
    def micro_batch_index(self) -> int:
        return self._position() // self.ranks

    @override
    def _accumulation(self) -> int:
        return super()._accumulation() // self.ranks


def _rank_ordered_sum(tensor: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """``tensor / W`` of every rank added in rank order, ``(t_0 / W + t_1 / W) + t_2 / W + ...`` over W ranks
    (as gradient accumulation adds the micro-batches' gradients of a loss divided by W)."""
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    total = parts[0] / len(parts)
    for part in parts[1:]:
        total = total + part / len(parts)
    return total


def rank_ordered_mean_hook(state: Any, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook averaging the ranks' gradients in rank order (see :class:`RankOrderedReduceScatter`)."""
    buffer = bucket.buffer()
    buffer.copy_(_rank_ordered_sum(buffer))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


# DDP compares the annotations with the classes themselves; this module's are strings (postponed evaluation).
rank_ordered_mean_hook.__annotations__.update({"bucket": torch.distributed.GradBucket, "return": torch.futures.Future[torch.Tensor]})


class RankOrderedReduceScatter:
    """FSDP2's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) adding the ranks' gradients in rank order.

    gloo adds more than two ranks' gradients in an order of its own (a ring, from a different rank
    for each chunk), and fp32 addition does not associate; gradient accumulation over
    :class:`SimulatedRanks` adds them in rank order. With this order on both sides, any difference
    left between a multi-process run and its one-process reference is the library's. Two ranks need
    it not: one addition commutes.
    """

    def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> None:
        if op != torch.distributed.ReduceOp.AVG:
            raise NotImplementedError(f"RankOrderedReduceScatter averages; FSDP2 asked for {op}")
        rank = torch.distributed.get_rank(group)
        output_tensor.copy_(_rank_ordered_sum(input_tensor, group).chunk(torch.distributed.get_world_size(group))[rank])


class RankOrderedReductions(Callback):
    """Average the ranks' gradients in rank order once the strategy has wrapped the model: DDP's
    communication hook (Lightning registers one on CUDA only), or :class:`RankOrderedReduceScatter` on
    every FSDP2 unit."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        wrapper = trainer.strategy.model
        if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
            wrapper.register_comm_hook(None, rank_ordered_mean_hook)
        for module in pl_module.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(RankOrderedReduceScatter())


def probe_forward_dtypes(model: LoopedLM) -> dict[str, set[str]]:
    """Record, from inside the forward, the dtypes that reach the recurrent block and the output block.

    ``h_in`` (the injected input), ``state`` (what each recurrent and output layer receives: s~_i
    and s_k), ``cond`` (the context c_i) and ``rope`` (the cos/sin tables the layers get). Hooks on
    the recurrent core run after a sharding unit's own pre-forward hook (FSDP2 prepends it), and
    those on the layers see what the layers compute with.
    """
    seen: dict[str, set[str]] = defaultdict(set)

    def core_input(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        seen["h_in"].add(str(args[0].dtype))

    def layer_input(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        x, ctx = args
        seen["state"].add(str(x.dtype))
        seen["rope"].update({str(ctx.positions.cos.dtype), str(ctx.positions.sin.dtype)})
        if ctx.cond is not None:
            seen["cond"].add(str(ctx.cond.dtype))

    model.core.register_forward_pre_hook(core_input)
    for layer in [*model.core.layers, *model.output_layers]:
        layer.register_forward_pre_hook(layer_input)
    return seen


#: The hybrid cases' token mixers: Gated DeltaProduct in the input and recurrent layers.
HYBRID_ARCH = dict(
    token_pattern={"in": ["gdp"], "rec": ["gdp"], "out": ["attention"]},
    mixers={"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct", "init_args": {"chunk_size": 8}}},
)


#: The MoE cases' channel mixers: 16 top-1 experts, so some expert gets no token on some rank at some
#: step; route replay in training, the balance loss and the aux-loss-free bias (summed over ranks).
MOE_ARCH = dict(
    channel_pattern=["moe"],
    route_replay="replay",
    mixers={
        "moe": {
            "class_path": "elr_lightning.mixers.MoE",
            "init_args": {"num_experts": 16, "top_k": 1, "expert_dim": 8, "aux_loss_coef": 0.05, "balance_rate": 0.01},
        }
    },
)


def tiny_module(
    virtual_ranks: int,
    conditioner_active: bool = True,
    meta_init: bool = False,
    hybrid: bool = False,
    moe: bool = False,
    depth_layout: str = "ranks",
    simulated_ranks: int = 0,
    **backprop: Any,
) -> ELRModule:
    """d = 32, one layer per block, K = 3, conditioning, one-loop overrides with f = 0.5; GDP layers if
    ``hybrid``; MoE channel mixers if ``moe``.

    ``simulated_ranks``: a :class:`SimulatedRanks` standing in for that many ranks (0: a plain module).
    ``backprop``: ``activation_checkpointing``, ``backprop_loops`` and ``compile_model`` of :class:`ELRModule`.
    """
    seed_everything(0)
    arch = dict(vocab_size=256, d_model=32, n_heads=2, n_in=1, n_rec=1, n_out=1, max_seq_len=32, max_loops=3)
    cls = type("SimulatedRanks", (SimulatedRanks,), {"ranks": simulated_ranks}) if simulated_ranks else ELRModule
    module = cls(
        arch=ModelConfig(**arch, **(HYBRID_ARCH if hybrid else {}), **(MOE_ARCH if moe else {})),
        sampler=OneLoopOverride(max_loops=3, override_fraction=0.5),
        conditioner=LoopConditioner(d_cond=16, rank=4, n_freqs=4),
        virtual_ranks=virtual_ranks,
        lr=1e-2,
        warmup_steps=0,
        loop_seed=7,
        meta_init=meta_init,
        depth_layout=depth_layout,
        **backprop,
    )
    if not conditioner_active:
        module.model.conditioner.set_active(False)
    return module


class LabelledText(TextDataModule):
    """Token windows served as labelled batches with unequal shards: next-token labels kept on the last
    three quarters of the positions of even rows and the first quarter of odd rows, -100 elsewhere.

    Each rank's local batch (an even number of rows) then holds as many targets as any other's, so
    the mean over each local batch, averaged over the ranks, is the mean over the global batch that
    the single-process reference takes; within a rank, shards of one row weigh 3 : 1.
    """

    def on_before_batch_transfer(self, batch: torch.Tensor, dataloader_idx: int) -> dict[str, torch.Tensor]:
        ids, targets = batch[:, :-1], batch[:, 1:]
        quarter = torch.arange(ids.shape[1]) >= ids.shape[1] // 4
        even = (torch.arange(ids.shape[0]) % 2 == 0)[:, None]
        keep = torch.where(even, quarter, ~quarter)
        return {"input_ids": ids, "labels": torch.where(keep, targets, IGNORE_INDEX)}


def collective_counts(profile: torch.profiler.profile) -> dict[str, int]:
    """How many times each collective ran in ``profile``: every ``c10d::`` op, and per FSDP2 unit its
    all-gathers (``FSDP::all_gather (<unit>)``) and gradient reductions (``FSDP::post_backward_reduce (<unit>)``).

    Ranks that issue different counts of any of them fall out of step: gloo then times out or aborts.
    """
    labels = ("c10d::", "FSDP::all_gather", "FSDP::post_backward_reduce")
    names = (event.name for event in profile.events())
    return dict(Counter(n for n in names if n.startswith(labels) and not n.startswith("FSDP::all_gather_copy")))


def make_strategy(name: Optional[str], timeout: timedelta = COLLECTIVE_TIMEOUT, **options: Any) -> Any:
    """The strategy under test: ``"ddp"``, ``"fsdp"`` or ``None`` (Lightning's single-device default).

    ``options``: more arguments of the strategy (``recurrent_units`` of the FSDP one).
    """
    if name is None:
        return "auto"
    cls = {"ddp": OneLoopOverrideDDPStrategy, "fsdp": OneLoopOverrideFSDPStrategy}[name]
    return cls(timeout=timeout, check_schedule_every_n_steps=1, **options)


def full_state(module: ELRModule) -> dict[str, torch.Tensor]:
    """The model's state with sharded tensors gathered (a collective under FSDP: every rank calls it)."""
    state = module.model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def train_case(case: dict[str, Any], spec: dict[str, Any], devices: int, num_nodes: int = 1) -> dict[str, Any]:
    """Train one case on ``num_nodes`` nodes of ``devices`` processes; return this rank's ``{"state", "loops", "rank", "fsdp_units"}``.

    A case names ``virtual_ranks``, the per-rank ``batch_size``, and optionally ``accumulate``
    (micro-batches per step), ``conditioner_active``, ``meta_init``, ``hybrid``, ``moe``, ``labelled`` (labelled
    batches, :class:`LabelledText`), ``activation_checkpointing``,
    ``backprop_loops``, ``compile_model`` (``torch.compile`` of the whole model with :data:`COMPILE_BACKEND`),
    ``strategy`` (instead of the spec's), ``recurrent_units`` and ``cpu_offload`` (of the FSDP strategy), ``depth_layout`` (of the module),
    ``simulated_ranks`` (a one-process reference, :class:`SimulatedRanks`), ``rank_ordered`` (gradients averaged in
    rank order, :class:`RankOrderedReduceScatter`),
    ``timeout_s`` (the collective timeout, default :data:`COLLECTIVE_TIMEOUT`), ``precision`` (Lightning's,
    default ``32-true``), ``save_checkpoint`` (write
    ``<out>/<case>.ckpt`` after training), ``init_from`` (a weights file
    that ``DelayedMixedDepth`` starts the mixed phase from), and ``nan_rank``/``nan_step``
    (that rank's loss is NaN at that step; the result is then ``{"rank", "error", "step"}``). The result also holds the
    per-micro-batch ``losses`` and ``utilisation`` (the logged ``train/rank_utilisation``) and, from the start of training, the ``initial`` state and the
    optimizer ``groups`` (``{name: {"weight_decay", "params"}}``) and this rank's ``expert_loads``
    per step and MoE layer, ``placement``: this process' ``global_rank``, ``node_rank``,
    ``local_rank``, ``num_nodes`` and ``data_parallel_rank`` as the trainer and strategy saw them,
    ``dtypes``: what :func:`probe_forward_dtypes` saw (sorted lists),
    ``betas`` (``[step, beta_mean]`` after each training forward) and ``beta_logged`` (the last step's
    ``train/beta_mean``; the last step is a logging step; NaN under ``compile_model``, which does not log it),
    ``optimizer``: its ``fused`` and ``foreach`` choice and the devices of its parameters' local tensors and state,
    ``fsdp_offloaded``: the values of FSDP2's ``offload_to_cpu`` over every sharded parameter (``[]`` without FSDP2).
    ``count_collectives`` profiles the run and returns :func:`collective_counts` as ``collectives`` (``{}`` otherwise).
    ``nccl_evaluation`` validates before training and runs the sanity check and a validation after every step,
    with Lightning choosing the evaluation context as on NCCL (:func:`evaluation_as_on_nccl`); every validation
    batch's ``[stage, sanity check, inference mode]`` is returned as ``evaluation_modes``.
    """
    backprop = {key: case[key] for key in ("activation_checkpointing", "backprop_loops", "compile_model") if key in case}
    module = tiny_module(
        case["virtual_ranks"],
        case.get("conditioner_active", True),
        case.get("meta_init", False),
        case.get("hybrid", False),
        case.get("moe", False),
        case.get("depth_layout", "ranks"),
        case.get("simulated_ranks", 0),
        **backprop,
    )
    if case.get("compile_model"):  # the module's own compile call, with a backend that skips code generation
        module.model.compile = functools.partial(module.model.compile, backend=COMPILE_BACKEND)
    data = (LabelledText if case.get("labelled") else TextDataModule)(
        sources=[spec["corpus"]], seq_len=16, batch_size=case["batch_size"], cache_dir=spec["cache_dir"], seed=3
    )
    record = RecordLoops(probe_forward_dtypes(module.model))
    modes = RecordEvaluationModes()
    callbacks: list[Callback] = [record, modes]
    evaluating = case.get("nccl_evaluation", False)
    strategy_options = {key: case[key] for key in ("recurrent_units", "cpu_offload") if key in case}
    if case.get("rank_ordered"):  # the ranks' gradients added in rank order, as SimulatedRanks accumulates them
        callbacks.append(RankOrderedReductions())
    if "init_from" in case:  # start the mixed phase from these weights, at step 0
        callbacks += [DelayedMixedDepth(init_from=case["init_from"]), ZeroInitConditioning()]
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=make_strategy(
            case.get("strategy", spec.get("strategy")),
            timedelta(seconds=case.get("timeout_s", COLLECTIVE_TIMEOUT.seconds)),
            **strategy_options,
        ),
        max_steps=spec["steps"],
        accumulate_grad_batches=case.get("accumulate", 1) * max(1, case.get("simulated_ranks", 0)),
        precision=case.get("precision", "32-true"),
        # the loss is checked on logging steps; the last step logs, so train/beta_mean is reduced there
        log_every_n_steps=1 if "nan_rank" in case else spec["steps"],
        limit_val_batches=1 if evaluating else 0,
        num_sanity_val_steps=1 if evaluating else 0,
        val_check_interval=1 if evaluating else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    betas: list[list[float]] = []  # [optimizer step, beta_mean] after each training forward on this rank
    if not case.get("compile_model"):  # compiled forwards do not measure beta_mean (nor log it)
        module.model.register_forward_hook(  # training forwards only, not the strategies' meta-device probes
            lambda model, args, out: betas.append([trainer.global_step, float(model.update.metrics()["beta_mean"])])
            if model.training and not out.is_meta
            else None
        )
    if "nan_rank" in case:  # this rank's loss turns NaN at that step, the other ranks' stays finite
        shard_loss = module.shard_loss

        def poisoned(batch: torch.Tensor, loops: list[int], *rest: Any) -> torch.Tensor:
            loss = shard_loss(batch, loops, *rest)
            hit = trainer.global_rank == case["nan_rank"] and trainer.global_step == case["nan_step"]
            return loss * float("nan") if hit else loss

        module.shard_loss = poisoned  # type: ignore[method-assign]
    counting = case.get("count_collectives", False)
    try:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profiler if counting else nullcontext() as prof:
            with evaluation_as_on_nccl() if evaluating else nullcontext():
                if evaluating:  # validate first, as a user checking a model before training does
                    trainer.validate(module, datamodule=data, verbose=False)
                trainer.fit(module, datamodule=data)
    except FloatingPointError as err:
        if "nan_rank" not in case:
            raise
        return {"rank": trainer.global_rank, "error": str(err), "step": trainer.global_step}
    if case.get("save_checkpoint") and "out" in spec:  # every rank calls it; the strategy picks the writer
        trainer.save_checkpoint(os.path.join(spec["out"], f"{case['name']}.ckpt"))
    units = [name for name, m in module.model.named_modules() if isinstance(m, FSDPModule)]
    groups = [m._get_fsdp_state()._fsdp_param_group for m in module.model.modules() if isinstance(m, FSDPModule)]
    offloaded = sorted({p.offload_to_cpu for group in groups if group is not None for p in group.fsdp_params})
    optimizer = trainer.optimizers[0]
    local = [p.to_local() if isinstance(p, DTensor) else p for g in optimizer.param_groups for p in g["params"]]
    state = [v.to_local() if isinstance(v, DTensor) else v for s in optimizer.state.values() for v in s.values()]
    return {
        "state": full_state(module),
        "loops": record.loops,
        "losses": record.losses,
        "utilisation": record.utilisation,
        "initial": record.initial,
        "groups": record.groups,
        "expert_loads": record.expert_loads,
        "betas": betas,
        "beta_logged": float(trainer.callback_metrics.get("train/beta_mean", float("nan"))),
        "rank": trainer.global_rank,
        "placement": {
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "num_nodes": trainer.num_nodes,
            "data_parallel_rank": getattr(trainer.strategy, "data_parallel_rank", trainer.global_rank),
        },
        "fsdp_units": units,
        "fsdp_offloaded": offloaded,
        "optimizer": {
            "fused": optimizer.defaults.get("fused"),
            "foreach": optimizer.defaults.get("foreach"),
            "devices": sorted({str(t.device) for t in local + state if isinstance(t, torch.Tensor)}),
        },
        "dtypes": {key: sorted(value) for key, value in record.dtypes.items()},
        "collectives": collective_counts(prof) if counting else {},
        "evaluation_modes": modes.modes,
    }


def main(spec_path: str) -> None:
    """Run every case of the spec on this rank and save the results."""
    with open(spec_path) as f:
        spec = json.load(f)
    faulthandler.dump_traceback_later(spec["watchdog_s"], exit=True)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as conftest.py does for the one-process references the tests compare with
    # torchrun says how many processes run on this node (LOCAL_WORLD_SIZE); a plain launch runs one node
    world = int(os.environ.get("WORLD_SIZE", "1"))
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    for case in spec["cases"]:
        result = train_case(case, spec, devices, world // devices)
        torch.save(result, os.path.join(spec["out"], f"{case['name']}.rank{result['rank']}.pt"))
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1])

"""``ELRModule``: the LightningModule that trains and validates a looped LM with the ELR recipe."""

from __future__ import annotations

import math
import os
from collections import UserDict
import warnings
from typing import Any, Mapping, MutableMapping, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.pytorch.core.saving import _default_map_location, _load_state, load_hparams_from_yaml
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric
from typing_extensions import override

from elr_lightning.batches import IGNORE_INDEX, Batch, TokenBatch
from elr_lightning.checkpoints.schema import LEGACY_HPARAMS_KEYS, build_plugin, module_arguments
from elr_lightning.conditioning import Conditioner
from elr_lightning.config import ModelConfig
from elr_lightning.model import LoopedLM
from elr_lightning.checkpoints.io import install_safe_checkpoint_io
from elr_lightning.checkpoints.record import check_loaded_checkpoint, check_sizes_before_build, record_checkpoint
from elr_lightning.module_checks import check_data_fits, check_meta_init, check_module_args, checked_sampler
from elr_lightning.optim import adamw, clip_without_scaler, param_groups, warmup_cosine
from elr_lightning.parameter_usage import check_plain_ddp
from elr_lightning.plugin_config import PluginConfigError, plain_hyperparameters
from elr_lightning.roles import copy_with_roles
from elr_lightning.checkpoints.safe_load import check_archive, check_regular_file, refuse_url, refusing_pickles, source_name
from elr_lightning.sampling import LoopSampler, OneLoopOverride
from elr_lightning.step_logging import (
    StepMeans, add_weighted, log_update_stats, loop_gains, rank_utilisation, ranks_wait_per_shard,
)
from elr_lightning.tokenizers import Tokenizer
from elr_lightning.updates import StateUpdate

# Plug-ins stay in the hparams on purpose, as their class_path + init_args (plugin_config.py), so
# ``load_from_checkpoint`` rebuilds them. Lightning's advice to ignore them would break that.
warnings.filterwarnings("ignore", message=r"Attribute '(update|conditioner)' is an instance of `nn.Module`")
# The module checks labelled batches on the host in transfer_batch_to_device; Lightning's note that it does
# so beside a data module is expected, not a problem.
warnings.filterwarnings("ignore", message=r"You have overridden `transfer_batch_to_device` in `LightningModule` but")


class ELRModule(LightningModule):
    """Trains a :class:`~elr_lightning.model.LoopedLM` with loop counts mixed within every step.

    Each local batch is split into ``virtual_ranks`` shards; together with the data-parallel ranks
    they make ``num_shards`` shards per optimizer step. The sampler assigns each shard its k as a pure
    function of ``(seed, global_step, shard, num_shards)`` (DESIGN §4), and the loss is the token
    mean over the whole step.

    A batch is a ``[B, T + 1]`` tensor of token windows or a labelled mapping ``{"input_ids",
    "labels"}`` with :data:`~elr_lightning.batches.IGNORE_INDEX` where there is no target
    (:mod:`elr_lightning.batches`); then every loss is the mean over labelled positions. Validation
    logs ``{val,test}/loss_k{k}`` and, unless the data module's ``token_bytes`` are all zero,
    ``bpb_k{k}`` (bits per UTF-8 byte of the targets).

    Args:
        arch: Architecture numbers; ``ModelConfig()`` by default.
        update: State-update rule; ``AdaptiveDelta()`` (eq. 2) by default.
        sampler: Loop sampler; ``OneLoopOverride(arch.max_loops, 0.15)`` (eq. 3) by default.
        conditioner: Loop conditioning (eq. 4), or ``None`` for none.

            The hyperparameters (and so every checkpoint) hold ``arch`` as the dict of its fields and
            each plug-in as ``{"class_path": ..., "init_args": {...}}``
            (:func:`~elr_lightning.plugin_config.plugin_config`), so checkpoints load with
            ``torch.load(..., weights_only=True)``; these four arguments accept that form too
            (:func:`~elr_lightning.checkpoints.schema.build_plugin`). A plug-in that cannot be described
            (its class defined in ``__main__``, a tensor argument, ...) is warned about here and
            refused, naming the field and the fix, when a checkpoint is saved.
        virtual_ranks: Shards per local batch, each with its own k (>= 1).
        val_loops: Loop counts to validate at; ``1..arch.max_loops`` by default. Values above
            ``arch.max_loops`` test extrapolation.
        lr: Peak learning rate.
        lr_scale: Multipliers of ``lr`` per optimizer group (``decay``, ``no_decay``, ``gate``,
            ``conditioning``; see :func:`~elr_lightning.optim.param_groups`), e.g. ``{gate: 10}``
            for a faster adaptive-delta gate; unnamed groups keep ``lr``. Every group warms up
            alike, then decays to the same floor, ``min_lr_ratio * lr``.
        weight_decay: AdamW weight decay for the ``decay`` group (matrices only).
        betas: AdamW betas.
        warmup_steps: Linear warmup steps before the cosine decay.
        min_lr_ratio: Final LR as a fraction of ``lr``.
        loop_seed: Seed of the loop schedule; ``None`` takes the run's ``seed_everything`` value.
        compile_layers: ``torch.compile`` every layer (one graph serves every k).
        compile_model: ``torch.compile`` the whole looped forward (``LoopedLM.compile()``): one graph
            per k and mode, the k-loop unrolled in it; dynamo's ``recompile_limit`` (8) bounds the
            graphs kept. Not together with ``compile_layers``.
        meta_init: Build the model on the meta device (no memory); ``OneLoopOverrideFSDPStrategy``
            then shards it, materialises each rank's shard and initialises it. For models too
            large to build in full on every rank's host. Needs a strategy whose
            ``materializes_meta_models`` is true (that one).
        activation_checkpointing: ``none``, ``loop`` (recompute each loop in the backward pass:
            activation memory nearly flat in k) or ``layer`` (recompute each layer); see
            :meth:`~elr_lightning.model.LoopedLM.set_backprop`. Gradients are the same.
        backprop_loops: Truncated backpropagation through the last n loops of each forward; the
            earlier loops run without a graph. ``None``: through all loops.
        depth_layout: Which shards of an optimizer step share a loop count. ``ranks`` (eq. 3 as the
            paper runs it): each of the ``ranks x virtual_ranks`` shards runs its own k, which every
            gradient-accumulation micro-batch of the step repeats, so ranks run different k at once
            and the step waits for the deepest. ``micro_batches``: the sampler draws one k per slot
            of the step's ``accumulate_grad_batches x virtual_ranks`` slots, and slot ``(m, v)``
            (micro-batch m, virtual rank v) runs it on every rank: depths mix across micro-batches
            and virtual ranks instead of ranks, every rank does the same work
            (``train/rank_utilisation`` 1) and no rank pads its passes. Eq. 3's p_1 and mean k hold
            over the slots (each slot is one shard on every rank); depths mix within a step only
            where there are at least two slots.
    """

    def __init__(
        self,
        arch: Optional[ModelConfig] = None,
        update: Optional[StateUpdate] = None,
        sampler: Optional[LoopSampler] = None,
        conditioner: Optional[Conditioner] = None,
        virtual_ranks: int = 1,
        val_loops: Optional[list[int]] = None,
        lr: float = 3e-3,
        lr_scale: Optional[dict[str, float]] = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        loop_seed: Optional[int] = None,
        compile_layers: bool = False,
        compile_model: bool = False,
        meta_init: bool = False,
        activation_checkpointing: str = "none",
        backprop_loops: Optional[int] = None,
        depth_layout: str = "ranks",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        try:
            self.hparams.update(plain_hyperparameters(self.hparams))
        except PluginConfigError as err:
            rank_zero_warn(f"{err}. Until then, checkpoints of this module cannot be saved")
        arch = ModelConfig() if arch is None else ModelConfig(**arch) if isinstance(arch, Mapping) else arch
        update = build_plugin(update, StateUpdate, "model.init_args.update")
        sampler = build_plugin(sampler, LoopSampler, "model.init_args.sampler")
        conditioner = build_plugin(conditioner, Conditioner, "model.init_args.conditioner")
        check_module_args(
            virtual_ranks=virtual_ranks, val_loops=val_loops, lr=lr, lr_scale=lr_scale, weight_decay=weight_decay,
            warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, compile_layers=compile_layers,
            compile_model=compile_model, depth_layout=depth_layout,
        )
        self.sampler = checked_sampler(OneLoopOverride(arch.max_loops, 0.15) if sampler is None else sampler, arch)
        self.virtual_ranks = virtual_ranks
        self.depth_layout = depth_layout
        self.val_loops = list(range(1, arch.max_loops + 1)) if val_loops is None else sorted(set(val_loops))
        # Plug-in objects are copied: the caller's (or an old checkpoint's unpickled) instances may share
        # storage with other tensors, and the model's init routine writes into what it owns.
        update, conditioner = copy_with_roles(update), copy_with_roles(conditioner)
        if meta_init:  # only the model: metrics and buffers below stay real
            with torch.device("meta"):
                # .to: the conditioner was built (and copied) outside, on the host
                self.model = LoopedLM(arch, update=update, conditioner=conditioner).to("meta")
        else:
            self.model = LoopedLM(arch, update=update, conditioner=conditioner)
        self.model.set_backprop(activation_checkpointing, backprop_loops)
        self.val_loss = nn.ModuleDict({str(k): MeanMetric() for k in self.val_loops})
        self.val_bpb = nn.ModuleDict({str(k): MeanMetric() for k in self.val_loops})
        self.register_buffer("token_bytes", torch.ones(arch.vocab_size), persistent=False)
        #: Whether validation logs bits per byte: false when the data module's ``token_bytes`` are all
        #: zero (targets that are not text, e.g. class ids of a synthetic task).
        self.reports_bpb = True
        self._seed = loop_seed
        #: The training tokenizer: taken from the data module in :meth:`setup`, saved in every
        #: checkpoint and restored from it on load (``None`` when neither provided one).
        self.tokenizer: Optional[Tokenizer] = None
        #: Per-expert load of each routed layer at the last logging step (see :meth:`on_before_optimizer_step`).
        self.expert_loads: dict[int, Tensor] = {}
        self._step_means = StepMeans()

    @property
    def arch(self) -> ModelConfig:
        """The architecture numbers."""
        return self.model.config

    @property
    def seed(self) -> int:
        """Seed of the loop schedule: the ``loop_seed`` argument, else the run's global seed, else 0."""
        return self._seed if self._seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    @override
    def forward(
        self,
        input_ids: Tensor,
        loops: int = 1,
        attention_mask: Optional[Tensor] = None,
        aux_losses: Optional[MutableMapping[str, Tensor]] = None,
        passes: Optional[int] = None,
    ) -> Tensor:
        return self.model(input_ids, loops, attention_mask, aux_losses=aux_losses, passes=passes)

    # ---- shards and loop counts -------------------------------------------------------------
    def data_parallel_layout(self) -> tuple[int, int]:
        """``(rank, size)`` of this process among the data-parallel ranks.

        A strategy with integer properties ``data_parallel_rank`` and ``data_parallel_size`` (the
        :class:`~elr_lightning.strategies.DataParallelLayout` protocol of the ELR strategies) is
        asked; under any other strategy every process is a data-parallel rank,
        ``(trainer.global_rank, trainer.world_size)``; without a trainer, ``(0, 1)``.
        """
        if self._trainer is None:
            return 0, 1
        strategy = self.trainer.strategy
        rank = getattr(strategy, "data_parallel_rank", None)
        size = getattr(strategy, "data_parallel_size", None)
        if rank is None or size is None:
            return self.trainer.global_rank, self.trainer.world_size
        return rank, size

    def num_shards(self) -> int:
        """Shards per optimizer step: data-parallel ranks times ``virtual_ranks``."""
        return self.data_parallel_layout()[1] * self.virtual_ranks

    def set_sampler(self, sampler: LoopSampler) -> None:
        """Install ``sampler`` as the loop sampler (e.g. :class:`~elr_lightning.callbacks.DelayedMixedDepth`).

        Raises:
            ValueError: ``sampler.max_loops`` exceeds the loop budget ``arch.max_loops``.
        """
        self.sampler = checked_sampler(sampler, self.arch)

    def micro_batch_index(self) -> int:
        """This micro-batch's index among the ``accumulate_grad_batches`` of its optimizer step (0 outside a fit)."""
        accumulate = self._accumulation()
        fit_loop = getattr(self._trainer, "fit_loop", None)
        if accumulate == 1 or fit_loop is None:
            return 0
        return max(fit_loop.epoch_loop.batch_progress.current.ready - 1, 0) % accumulate

    def _accumulation(self) -> int:
        return int(getattr(self._trainer, "accumulate_grad_batches", 1)) if self._trainer is not None else 1

    def step_schedule(self, step: Optional[int] = None, micro_batch: Optional[int] = None) -> list[int]:
        """The k of every shard (all ranks) of one micro-batch of optimizer step ``step``.

        Defaults: the current step and micro-batch. Under ``depth_layout: ranks`` it is the
        sampler's schedule over ``num_shards()`` shards, the same for every micro-batch of the step;
        under ``micro_batches`` the sampler schedules the step's slots (:meth:`step_slots`) and shard
        ``r * virtual_ranks + v`` of micro-batch m runs slot ``m * virtual_ranks + v``'s k on every rank r.
        """
        step = self.trainer.global_step if step is None else step
        if self.depth_layout == "ranks":
            return self.sampler.schedule(self.seed, step, self.num_shards())
        m = self.micro_batch_index() if micro_batch is None else micro_batch
        slots = self.step_slots(step)[m * self.virtual_ranks : (m + 1) * self.virtual_ranks]
        return slots * self.data_parallel_layout()[1]

    def step_slots(self, step: int) -> list[int]:
        """Under ``depth_layout: micro_batches``, the k of each of the step's ``accumulate_grad_batches x virtual_ranks`` slots."""
        return self.sampler.schedule(self.seed, step, self._accumulation() * self.virtual_ranks)

    def step_schedules(self, step: Optional[int] = None) -> list[list[int]]:
        """:meth:`step_schedule` of each distinct micro-batch of optimizer step ``step`` (one under ``ranks``)."""
        if self.depth_layout == "ranks":
            return [self.step_schedule(step)]
        return [self.step_schedule(step, m) for m in range(self._accumulation())]

    def collective_passes(self) -> Optional[list[int]]:
        """Recurrent passes of each local shard's forward where the strategy needs every rank to make as many.

        A strategy that shards each recurrent layer on its own says so with a true
        ``pads_recurrent_passes``; then shard ``v`` of every rank makes as many passes as the deepest
        of them runs loops (``LoopedLM.forward(..., passes=...)``). ``None`` otherwise (no padding).
        """
        if self._trainer is None or not getattr(self.trainer.strategy, "pads_recurrent_passes", False):
            return None
        schedule = self.step_schedule()
        return [max(schedule[v :: self.virtual_ranks]) for v in range(self.virtual_ranks)]

    def local_shards(self) -> slice:
        """This rank's shards among all ``num_shards()`` of a step."""
        first = self.data_parallel_layout()[0] * self.virtual_ranks
        return slice(first, first + self.virtual_ranks)

    def local_loops(self, step: Optional[int] = None) -> list[int]:
        """The k of this rank's ``virtual_ranks`` shards."""
        return self.step_schedule(step)[self.local_shards()]

    # ---- lifecycle ---------------------------------------------------------------------------
    @override
    def setup(self, stage: str) -> None:
        """Check the run before it starts (meta init, DDP, the data's fit to the model) and take the data
        module's tokenizer and bytes per token (for bits per byte)."""
        check_meta_init(self)
        install_safe_checkpoint_io(self.trainer.strategy)  # before Lightning restores a --ckpt_path
        if stage == "fit":
            check_plain_ddp(self.trainer.strategy, self.model)
        datamodule = getattr(self.trainer, "datamodule", None)
        check_data_fits(datamodule, self.arch, self.virtual_ranks, stage)
        tokenizer = getattr(datamodule, "tokenizer", None)
        if tokenizer is not None:
            self.tokenizer = tokenizer
        token_bytes = getattr(datamodule, "token_bytes", None)
        if token_bytes is not None:
            padded = torch.zeros(self.arch.vocab_size)
            padded[: len(token_bytes)] = torch.as_tensor(token_bytes, dtype=torch.float32)
            self.token_bytes = padded.to(self.token_bytes.device)
            self.reports_bpb = bool(padded.any())

    @override
    def configure_model(self) -> None:
        if self.hparams.compile_layers:
            # Static shapes: a recompile with automatic dynamic shapes during activation checkpointing's
            # recomputation (a routed layer's scratch changed) would save other tensors than the forward.
            for layer in self.all_layers():
                layer.compile(dynamic=False)
        if self.hparams.get("compile_model", False):
            self.model.compile()

    def all_layers(self) -> list[nn.Module]:
        """Every transformer layer: input, recurrent and output."""
        m = self.model
        return [*m.input_layers, *m.core.layers, *m.output_layers]

    # ---- training ----------------------------------------------------------------------------
    def shard_loss(
        self,
        batch: Batch,
        loops: list[int],
        aux_losses: Optional[dict[str, Tensor]] = None,
        update_stats: Optional[dict[str, Tensor]] = None,
        passes: Optional[list[int]] = None,
    ) -> Tensor:
        """Cross-entropy of ``batch`` split into ``len(loops)`` shards, the mean over its labelled tokens.

        ``batch`` is a ``[B, T + 1]`` tensor of token windows or a labelled mapping ``{"input_ids",
        "labels"}`` (:mod:`elr_lightning.batches`); both are split alike into shards of consecutive
        sequences, shard ``j`` running ``loops[j]``. The loss sums every shard's cross-entropy over its
        labelled positions and divides by the labelled positions of the whole batch, so a shard with
        more targets weighs more, and a batch without any gives 0 (not 0/0).

        ``aux_losses``, if given, receives the mixers' auxiliary losses (e.g. ``moe_aux_loss``), each
        the shards' mean weighted by their sequences. ``update_stats``, if given, receives the
        state-update rule's ``metrics()`` read right after each shard's forward (activation
        checkpointing recomputes the loops in backward, after the read), weighted the same way.
        ``passes``, if given, are the recurrent passes of each shard's forward (:meth:`collective_passes`).
        """
        tokens = TokenBatch.of(batch)
        if tokens.rows < len(loops):
            raise ValueError(
                f"the local batch has {tokens.rows} sequences, fewer than virtual_ranks={len(loops)}; "
                "raise data.batch_size or lower virtual_ranks"
            )
        total = tokens.inputs.new_zeros((), dtype=torch.float32)
        for shard, k, n in zip(tokens.shards(len(loops)), loops, passes or [None] * len(loops)):
            # Not a dict: FSDP2's root copies dict arguments when it moves the inputs to the device.
            aux: UserDict[str, Tensor] = UserDict()
            logits = self(shard.inputs, k, aux_losses=aux, passes=n)
            total = total + F.cross_entropy(
                logits.flatten(0, 1).float(), shard.labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
            )
            weight = shard.rows / tokens.rows
            if aux_losses is not None:
                add_weighted(aux_losses, aux, weight)
            if update_stats is not None:
                add_weighted(update_stats, self.model.update.metrics(), weight)
        return total / tokens.labelled_tokens()

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """The step's loss: each local shard of ``batch`` at its k of :meth:`step_schedule`, plus the mixers'
        auxiliary losses; logs them, the mean k and p_1.

        Raises:
            FloatingPointError: The loss is not finite on some rank (checked on logging steps).
        """
        schedule = self.step_schedule()
        loops = schedule[self.local_shards()]
        aux: dict[str, Tensor] = {}
        # Compiled, the update rule keeps no statistics (updates.py): log none rather than a stale one.
        stats: Optional[dict[str, Tensor]] = None if self.hparams.get("compile_model", False) else {}
        loss = self.shard_loss(batch, loops, aux, stats, self.collective_passes())
        loss = loss + sum(aux.values(), start=torch.zeros_like(loss))
        for name, value in aux.items():  # a copy: syncing under some strategies reduces in place
            self.log(f"train/{name}", self._step_means(name, value, self.trainer.global_step), sync_dist=True)
        # Reading the loss stalls the device: check it on the steps that log it anyway. Every rank
        # takes part, so a rank-local NaN stops all ranks together, not at the collective timeout.
        if self.trainer.global_step % self.trainer.log_every_n_steps == 0:
            finite = bool(torch.isfinite(loss))
            if not self.trainer.strategy.reduce_boolean_decision(finite, all=True):
                where = f"is {loss.item()}" if not finite else "is finite here but not on another rank"
                raise FloatingPointError(
                    f"train/loss {where} at step {self.trainer.global_step} (loops {loops}); "
                    "lower model.init_args.lr, raise warmup_steps, or set trainer.gradient_clip_val"
                )
        self.log("train/loss", self._step_means("loss", loss, self.trainer.global_step), prog_bar=True, sync_dist=True)
        schedules = self.step_schedules()
        shards = [k for micro_batch in schedules for k in micro_batch]
        self.log("train/loops_mean", sum(shards) / len(shards))
        self.log("train/p1", sum(k == 1 for k in shards) / len(shards))
        ranks = self.data_parallel_layout()[1]
        waits = ranks_wait_per_shard(self.trainer.strategy)
        utilisation = rank_utilisation(schedules, ranks, self.arch.effective_depth, waits)
        self.log("train/rank_utilisation", utilisation)
        log_update_stats(self, stats or {}, self._step_means)
        return loss

    @override
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Check a labelled batch's ids while it is still on the host, then move it.

        On the host the check costs no device sync; an out-of-range id would otherwise fail inside
        the embedding or the loss (on a GPU, as an opaque device-side assert).

        Raises:
            ValueError: A labelled batch is malformed or holds an id outside the vocabulary
                (:meth:`~elr_lightning.batches.TokenBatch.check_ids`).
        """
        if isinstance(batch, Mapping):
            TokenBatch.of(batch).check_ids(self.arch.vocab_size)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_start(self) -> None:
        for layer in self.all_layers():  # strategies probe the model at setup: that is no training step
            layer.mlp.discard_step()

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Let routed mixers update their balancing state; log each one's expert-load CV.

        On logging steps the per-expert loads are kept in :attr:`expert_loads` (layer index to
        ``[E]``), which :class:`~elr_lightning.callbacks.LoopCountPlots` draws as histograms.
        """
        log = self.trainer.global_step % self.trainer.log_every_n_steps == 0
        self.expert_loads = {}
        for layer in self.all_layers():
            load = layer.mlp.end_step(lambda t: self.trainer.strategy.reduce(t, reduce_op="sum"))
            if load is None or not log:
                continue
            self.expert_loads[layer.index] = load.detach()
            cv = load.std(correction=0) / load.mean().clamp_min(1e-9)
            self.log(f"train/moe_load_cv/layer{layer.index}", cv, rank_zero_only=True)

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Lightning's clipping, which also clips a fused AdamW's gradients under ``bf16-mixed``.

        See :func:`~elr_lightning.optim.clip_without_scaler`.
        """
        clip_val = self.trainer.gradient_clip_val if gradient_clip_val is None else gradient_clip_val
        algorithm = gradient_clip_algorithm or self.trainer.gradient_clip_algorithm or "norm"
        if not clip_without_scaler(self.trainer.precision_plugin, optimizer, float(clip_val or 0.0), algorithm):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ---- validation --------------------------------------------------------------------------
    def sequence_nll(self, batch: Batch, loops: int) -> Tensor:
        """Summed negative log-likelihood of each sequence's labelled targets: ``[B]``.

        ``batch`` in either form of :mod:`elr_lightning.batches`: token windows ``[B, T + 1]`` (every
        next token) or a labelled mapping (positions labelled :data:`~elr_lightning.batches.IGNORE_INDEX`
        add nothing).
        """
        tokens = TokenBatch.of(batch)
        logits = self(tokens.inputs, loops)
        nll = F.cross_entropy(
            logits.transpose(1, 2).float(), tokens.labels, reduction="none", ignore_index=IGNORE_INDEX
        )
        return nll.sum(dim=1)

    def _evaluate(self, batch: Batch) -> None:
        tokens = TokenBatch.of(batch)
        count = tokens.labelled_tokens()
        nbytes = (self.token_bytes[tokens.labels.clamp_min(0)] * tokens.mask()).sum()  # of labelled targets only
        for k in self.val_loops:
            nll = self.sequence_nll(batch, k).sum()
            self.val_loss[str(k)].update(nll / count, count)
            if nbytes > 0:
                self.val_bpb[str(k)].update(nll / nbytes / math.log(2), nbytes)

    def _log_evaluation(self, prefix: str) -> None:
        # compute() already reduces each metric over the ranks, so every rank logs the same values;
        # sync_dist averages those equal values and keeps Lightning from warning that they are rank-local.
        losses = {}
        for k in self.val_loops:
            losses[k] = float(self.val_loss[str(k)].compute())
            self.log(f"{prefix}/loss_k{k}", losses[k], prog_bar=k in (1, self.val_loops[-1]), sync_dist=True)
            if self.reports_bpb:
                self.log(f"{prefix}/bpb_k{k}", self.val_bpb[str(k)].compute(), sync_dist=True)
            with torch.inference_mode(False):  # states re-made here must not be inference tensors
                self.val_loss[str(k)].reset()
                self.val_bpb[str(k)].reset()
        for name, value in loop_gains(losses, self.arch.max_loops).items():
            self.log(f"{prefix}/{name}", value, sync_dist=True)

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch)

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_evaluation("val")

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch)

    @override
    def on_test_epoch_end(self) -> None:
        self._log_evaluation("test")

    @override
    def predict_step(self, batch: Batch, batch_idx: int) -> dict[int, Tensor]:
        """Mean loss of each sequence over its labelled targets at every k in ``val_loops``: ``{k: [B]}``."""
        per_row = TokenBatch.of(batch).labelled_per_row()
        return {k: self.sequence_nll(batch, k) / per_row for k in self.val_loops}

    # ---- optimizer ---------------------------------------------------------------------------
    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = param_groups(self.model, hp.weight_decay, hp.lr, hp.get("lr_scale"))
        optimizer = adamw(groups, lr=hp.lr, betas=tuple(hp.betas))
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("set trainer.max_steps or trainer.max_epochs: the cosine schedule needs a length")
        scheduler = warmup_cosine(optimizer, hp.warmup_steps, int(total), hp.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- checkpoints -------------------------------------------------------------------------
    @classmethod
    @override
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Optional[str] = None,
        strict: Optional[bool] = None, weights_only: Optional[bool] = None, **kwargs: Any,
    ) -> Any:  # fmt: skip
        """Lightning's ``load_from_checkpoint``, the file read as data (:mod:`elr_lightning.checkpoints.safe_load`).

        Unless ``weights_only=False`` is given, the file is read once with ``torch.load(...,
        weights_only=True)`` (a pickled object is refused in one line), and what it says about the
        model is checked against the constructor's schema before anything is built
        (:func:`~elr_lightning.checkpoints.schema.module_arguments`): plain data everywhere, classes only
        in the plug-ins' fields, and only from ``elr_lightning`` and the modules you trust
        (``ELR_TRUST_MODULES`` or :func:`~elr_lightning.checkpoints.trust.trust_modules`). Lightning then builds the
        module (its ``_load_state``: ``configure_model``, ``on_load_checkpoint``, the strict state-dict
        load) from those checked arguments alone: the file's own hyperparameters never reach it, and
        its ``_instantiator`` is never called. A ``hparams_file`` replaces the checkpoint's
        hyperparameters, checked the same way. An explicit ``weights_only=False`` trusts the file whole,
        as in Lightning.
        """
        if weights_only is False:
            return super().load_from_checkpoint(checkpoint_path, map_location, hparams_file, strict, False, **kwargs)
        name = source_name(checkpoint_path)
        if isinstance(checkpoint_path, (str, os.PathLike)):
            refuse_url(checkpoint_path, "checkpoint_path")
            check_regular_file(checkpoint_path, "checkpoint_path")
            check_archive(os.fspath(checkpoint_path))
        with refusing_pickles(name):
            checkpoint = pl_load(checkpoint_path, map_location=map_location or _default_map_location, weights_only=True)
        overrides = load_hparams_from_yaml(hparams_file) if hparams_file is not None else None
        size = os.path.getsize(checkpoint_path) if isinstance(checkpoint_path, (str, os.PathLike)) else None
        return cls.from_checkpoint_dict(checkpoint, name, overrides, strict, available=size, **kwargs)

    @classmethod
    def from_checkpoint_dict(
        cls, checkpoint: dict[str, Any], source: str, overrides: Optional[Mapping[str, Any]] = None,
        strict: Optional[bool] = None, available: Optional[int] = None, **kwargs: Any,
    ) -> Any:  # fmt: skip
        """The module a checkpoint already read as data describes, as :meth:`load_from_checkpoint` builds it.

        For a checkpoint that is no single file (a sharded folder, read by
        :func:`~elr_lightning.checkpoints.io.read_sharded_checkpoint`). Its configuration is checked
        against the schema (:func:`~elr_lightning.checkpoints.schema.module_arguments`), and its sizes
        against the tensors it holds, before anything is built
        (:func:`~elr_lightning.checkpoints.record.check_sizes_before_build`).

        Args:
            checkpoint: The checkpoint, as ``torch.load(..., weights_only=True)`` returns it; changed in place.
            source: The file or folder, for messages.
            overrides: Hyperparameters that replace the checkpoint's (a ``hparams_file``'s).
            strict: As for :meth:`load_from_checkpoint`.
            available: The bytes of the file it was read from, which its tensors may not exceed (twice,
                for tied weights); ``None`` for a sharded folder, whose index bounds them.
            kwargs: Constructor arguments that replace the checkpoint's.
        """
        target, arguments = module_arguments(checkpoint, cls, source, overrides)
        check_sizes_before_build(target, {**arguments, **kwargs}, checkpoint, source, available, strict)
        for key in (*LEGACY_HPARAMS_KEYS, "hparams_name"):
            checkpoint.pop(key, None)
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = dict(arguments)  # what hooks read is what was checked
        module = _load_state(target, checkpoint, strict=strict, **{**arguments, **kwargs})
        tensors = (t for t in checkpoint.get("state_dict", {}).values() if isinstance(t, Tensor))
        return module.to(next(tensors, torch.tensor(0)).device)  # as Lightning: where the weights were mapped

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the architecture, loop schedule and tokenizer; refuse non-finite weights or plug-ins that are
        not plain data (:func:`~elr_lightning.checkpoints.record.record_checkpoint`)."""
        record_checkpoint(self, checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another architecture or schedule; restore its tokenizer
        (:func:`~elr_lightning.checkpoints.record.check_loaded_checkpoint`)."""
        check_loaded_checkpoint(self, checkpoint)

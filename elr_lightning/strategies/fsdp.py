"""``OneLoopOverrideFSDPStrategy``: FSDP2 data parallelism for ranks that run different loop counts."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import (
    _is_sharded_checkpoint,
    _load_checkpoint,
    _rekey_optimizer_state_if_needed,
)
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from typing_extensions import override

try:  # FSDP2's public home since torch 2.6
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 and 2.5 (pyproject allows torch>=2.4) ship it under a private path
    from torch.distributed._composable.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from elr_lightning.checkpoints.io import check_sharded_folder, read_sharded_meta
from elr_lightning.checkpoints.safe_load import load_sharded, refusing_pickles
from elr_lightning.model import LoopedLM
from elr_lightning.strategies.common import find_looped_lm, loop_dependent_parameters, verify_loop_schedule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


#: ``recurrent_units`` of :func:`shard_looped_lm`: the recurrent block as one unit, or one unit per recurrent layer.
RECURRENT_UNITS = ("core", "layer")

#: Lightning precisions whose autocast computes in half precision, and the dtype FSDP2 gathers in for them.
_HALF_PRECISIONS = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def mixed_precision_policy(precision: str) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's policy for a Lightning ``precision``: half-precision gathers, fp32 gradient reduction.

    Under ``bf16-mixed`` autocast computes in bf16 anyway; without a policy ``fully_shard`` would
    all-gather the fp32 shards (twice the bytes) and autocast would cast them after. The policy
    gathers in bf16 and reduce-scatters gradients in fp32; the sharded parameters and the optimizer
    stay fp32. ``None`` for full precision.

    The precision regime is DDP's with autocast: the activations between units (the injected input
    h_in, the recurrent state s_i, the context c_i) and the RoPE tables keep the dtype the forward
    gives them, and autocast decides per op. FSDP2's default would cast every floating-point input of
    every unit to the gather dtype (``cast_forward_inputs``), so the k-loop's state would run in bf16
    under FSDP and in fp32 under DDP: two different models. The policy is for the layer units;
    :func:`shard_looped_lm` gathers the root (embedding, final norm, head) in fp32.
    """
    dtype = _HALF_PRECISIONS.get(precision)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_looped_lm(
    model: LoopedLM,
    mesh: "DeviceMesh",
    reshard_after_forward: bool = True,
    reduce_scatter_unused_params: bool = False,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    recurrent_units: str = "layer",
    cpu_offload: bool = False,
) -> None:
    """Apply FSDP2 ``fully_shard`` to ``model`` in place, in units whose collectives do not depend on k.

    Units: each input layer, the recurrent block, each output layer, then the root (embedding,
    final norm and the tied head). The recurrent block is sharded by ``recurrent_units``:

    * ``layer``: each recurrent layer is a unit, then the :class:`~elr_lightning.model.RecurrentCore`
      (the state update and the conditioner). A layer gathers its weights at every loop and frees
      them after, so no more than a layer or two of the block is gathered at once, and in the
      backward pass it reduce-scatters its gradient at every loop. A layer called k times issues k
      gathers per forward: the model must then make the same number of passes on every rank,
      which ``LoopedLM.forward(..., passes=...)`` does (idle passes on zero rows;
      :meth:`ELRModule.collective_passes <elr_lightning.module.ELRModule.collective_passes>` asks
      for the deepest k of the shard's peers). Eq. 4's terms are then computed by each layer in its
      own forward (``RecurrentCore.batch_modulations`` off), where its heads are gathered.
    * ``core``: the whole core is one unit (its ``forward`` runs all k loops, so it all-gathers once
      per forward and reduce-scatters once per backward at any k, with no padding), at the cost of
      the whole block's weights, gradients and communication buffers gathered at once.

    ``fully_shard`` replaces every parameter by a new sharded one and drops attributes set on the
    old ones; roles survive because the model records them by name (``LoopedLM.roles``).

    Args:
        model: The unsharded model.
        mesh: The 1-D data-parallel mesh (a 2-D mesh replicates instead of sharding).
        reshard_after_forward: Free the gathered parameters of the non-root units after forward
            (gather again for backward); ``False`` keeps them, trading memory for communication.
        reduce_scatter_unused_params: Reduce-scatter zero gradients for parameters that took no
            part in a rank's backward (needed when ranks use different parameters, e.g. MoE).
        mp_policy: FSDP2 mixed precision of the layer units and the core (:func:`mixed_precision_policy`);
            ``None`` gathers and reduces in the parameters' dtype. The root gathers in the parameters'
            dtype always: an embedding gathered in bf16 would start the residual stream, and so h_in
            and the recurrent state, in bf16, where DDP under autocast keeps them fp32 (the head's
            matmul still runs in bf16 under autocast). It costs one fp32 gather of the root per step
            (FSDP2 keeps the root gathered between forward and backward).
        recurrent_units: ``layer`` or ``core`` (above).
        cpu_offload: Pass torch's ``CPUOffloadPolicy`` to every ``fully_shard`` call, as torchtitan's
            ``enable_cpu_offload`` does: the rank's parameter shards, gradient shards and so the
            optimizer's state live in host memory; a unit's shards are copied to the mesh's device
            for its all-gather, and its reduce-scattered gradient shards back. The shards must be on
            the CPU when training starts. Memory is pinned where the mesh is not the CPU's (a
            CPU-only machine cannot pin).

    Raises:
        ValueError: ``recurrent_units`` is neither, or ``reduce_scatter_unused_params`` on a torch without it.
    """
    if recurrent_units not in RECURRENT_UNITS:
        raise ValueError(f"recurrent_units={recurrent_units!r} must be one of {', '.join(RECURRENT_UNITS)}")
    policy: dict[str, Any] = {} if mp_policy is None else {"mp_policy": mp_policy}
    if cpu_offload:
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    for layer in model.input_layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, **policy)
    if recurrent_units == "layer":
        for layer in model.core.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, **policy)
        model.core.batch_modulations = False
    fully_shard(model.core, mesh=mesh, reshard_after_forward=reshard_after_forward, **policy)
    for layer in model.output_layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, **policy)
    root_policy = {key: value for key, value in policy.items() if key != "mp_policy"}
    if mp_policy is not None:
        root_policy["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=mp_policy.reduce_dtype)
    root = fully_shard(model, mesh=mesh, **root_policy)
    if reduce_scatter_unused_params:
        if not hasattr(root, "set_reduce_scatter_unused_params"):
            raise ValueError(
                "reduce_scatter_unused_params: true needs a torch whose FSDP2 has set_reduce_scatter_unused_params "
                f"(this is torch {torch.__version__}); upgrade torch or use every parameter at every k"
            )
        root.set_reduce_scatter_unused_params(True)


def evaluate_under_no_grad(trainer: "pl.Trainer") -> None:
    """Make ``trainer`` validate, test and predict under ``torch.no_grad`` rather than ``torch.inference_mode``.

    Lightning runs those loops under ``inference_mode`` unless the process group is gloo or the
    strategy is its own ``FSDPStrategy`` (``lightning.pytorch.loops.utilities._no_grad_context``;
    pytorch/pytorch#95957), and its ``ModelParallelStrategy``, this strategy's base, is not one. An
    FSDP2 forward under ``inference_mode`` makes the buffers that the units gather into inference
    tensors, and the next training forward fails ("Inplace update to inference tensor outside
    InferenceMode"): on NCCL, a ``trainer.validate`` (or ``test``, ``predict``) before ``trainer.fit``
    crashed the first training step. The loops' own ``inference_mode`` flag (``Trainer(inference_mode=False)``)
    is what the choice falls back to; fit's validation (the sanity check included) already has it off.
    """
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        loop.inference_mode = False


class OneLoopOverrideFSDPStrategy(ModelParallelStrategy):
    """FSDP2 (``fully_shard``) over all ranks for mixed-depth training; runs on CPU (gloo) and GPU.

    Lightning's ``FSDPStrategy`` (FSDP1) refuses the CPU; this builds on its
    ``ModelParallelStrategy`` with a 1-D data-parallel mesh over every process (no tensor
    parallelism). The strategy shards the module's :class:`~elr_lightning.model.LoopedLM` with
    :func:`shard_looped_lm` after ``configure_model`` and before the optimizer is built; model code
    is untouched. The data-parallel rank and size come from the mesh. A model built on the meta
    device (``ELRModule(meta_init=True)``) is materialised after sharding, each rank allocating its
    shard only, and initialised with ``LoopedLM.init_weights``. Under ``bf16-mixed`` (or ``16-mixed``)
    the units gather their parameters in half precision (:func:`mixed_precision_policy`).

    With ``recurrent_units: layer`` (the default) each recurrent layer is its own unit, so the
    recurrent block is never gathered whole; every rank's forward makes as many passes of it as the
    deepest rank's shard runs loops (:attr:`pads_recurrent_passes`): a rank past its own k calls
    the layers on zero rows, which gathers and reduce-scatters without arithmetic. With
    ``ELRModule(depth_layout="micro_batches")`` all ranks run one k per micro-batch and no rank
    pads. ``recurrent_units: core`` keeps the whole block one unit (DESIGN §6).

    With ``cpu_offload: true`` every unit is sharded with torch's ``CPUOffloadPolicy``
    (:func:`shard_looped_lm`): the parameter shards, their gradients and AdamW's state stay in host
    memory and the optimizer steps on the CPU (:func:`~elr_lightning.optim.adamw` picks the CPU's
    fused kernel by the parameters' device), so the accelerator holds the gathered units and the
    activations only. That is what lets ``config/30b_a3b.yaml`` train on one node of 8 x 80 GB
    (``elr estimate`` models it; docs/memory.md), at the price of a host-to-device copy of every
    unit's shards at each gather, a device-to-host copy of every gradient shard, and the optimizer
    step on the CPU. A meta-device model is materialised on the CPU; buffers and any parameter the
    strategy does not shard go to the accelerator as usual. On an accelerator the process group is
    ``<device>:<backend>,cpu:gloo`` (as torchtitan's), since gradient clipping and checkpoints run
    collectives on the CPU shards; an explicit ``process_group_backend`` wins.

    Validation, testing and prediction run under ``torch.no_grad``, never ``torch.inference_mode``
    (:func:`evaluate_under_no_grad`), as under Lightning's own ``FSDPStrategy``.

    Every rank must reduce-scatter the same parameters at every step, whatever k it runs. At setup
    the strategy probes the unsharded model at k = 1..``arch.max_loops`` (conditioner as it is and
    switched on) and raises if some parameter's use depends on k. Parameters unused at every k
    (the conditioning heads before the delayed switch) are fine: every rank skips them alike and
    their gradient stays ``None``, as under DDP. ``reduce_scatter_unused_params=True`` lifts the
    check by giving skipped parameters zero gradients instead (AdamW then counts those steps).

    Args:
        reshard_after_forward: See :func:`shard_looped_lm`.
        reduce_scatter_unused_params: See :func:`shard_looped_lm`; also turns the k probe off.
        recurrent_units: ``layer`` or ``core``, see :func:`shard_looped_lm`.
        cpu_offload: Keep parameter shards, gradient shards and the optimizer's state in host memory
            (above; :func:`shard_looped_lm`).
        check_schedule_every_n_steps: Every this many optimizer steps, gather the loop counts the
            ranks run and raise if they are not one shared schedule (``0``: never).
        save_distributed_checkpoint: One checkpoint file per rank (``True``) or one full file.
        process_group_backend: ``"gloo"``, ``"nccl"``, ... (default: by device).
        timeout: Collective timeout.
    """

    #: ``ELRModule(meta_init=True)`` asks for this: the strategy materialises and initialises the shards.
    materializes_meta_models = True

    def __init__(
        self,
        reshard_after_forward: bool = True,
        reduce_scatter_unused_params: bool = False,
        check_schedule_every_n_steps: int = 100,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        recurrent_units: str = "layer",
        cpu_offload: bool = False,
    ) -> None:
        if check_schedule_every_n_steps < 0:
            raise ValueError(
                f"check_schedule_every_n_steps={check_schedule_every_n_steps} must be >= 0 (0 turns the check off)"
            )
        if recurrent_units not in RECURRENT_UNITS:
            raise ValueError(
                f"recurrent_units={recurrent_units!r} must be one of {', '.join(RECURRENT_UNITS)} "
                "(one unit per recurrent layer, or the whole recurrent block as one)"
            )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.reshard_after_forward = reshard_after_forward
        self.reduce_scatter_unused_params = reduce_scatter_unused_params
        self.check_schedule_every_n_steps = check_schedule_every_n_steps
        self.recurrent_units = recurrent_units
        self.cpu_offload = bool(cpu_offload)

    @property
    def pads_recurrent_passes(self) -> bool:
        """Whether every rank's forward must make as many recurrent passes as its peers' (``recurrent_units: layer``)."""
        return self.recurrent_units == "layer"

    def _data_parallel_mesh(self) -> Optional["DeviceMesh"]:
        """The data-parallel mesh, or ``None`` before the processes have joined (Lightning's ``device_mesh`` raises then)."""
        try:
            return self.device_mesh["data_parallel"]
        except RuntimeError:
            return None

    @property
    def data_parallel_rank(self) -> int:
        """This process' rank in the data-parallel mesh (its global rank before the mesh exists)."""
        mesh = self._data_parallel_mesh()
        return self.global_rank if mesh is None else mesh.get_local_rank()

    @property
    def data_parallel_size(self) -> int:
        """Size of the data-parallel mesh (the world size before the mesh exists)."""
        mesh = self._data_parallel_mesh()
        return self.world_size if mesh is None else mesh.size()

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        evaluate_under_no_grad(trainer)
        model = find_looped_lm(self.lightning_module)
        if not isinstance(model.core, FSDPModule):
            if not self.reduce_scatter_unused_params:
                self._require_loop_independent_parameters(model)
            shard_looped_lm(
                model,
                self.device_mesh["data_parallel"],
                reshard_after_forward=self.reshard_after_forward,
                reduce_scatter_unused_params=self.reduce_scatter_unused_params,
                mp_policy=mixed_precision_policy(str(self.precision_plugin.precision)),
                recurrent_units=self.recurrent_units,
                cpu_offload=self.cpu_offload,
            )
            if any(p.is_meta for p in model.parameters()):
                # Built with meta_init: give each rank's shard memory, then the model's own init.
                # Done here, not by Lightning's materialisation below, which would empty the whole
                # LightningModule (metrics, buffers) and run nn.Linear's reset_parameters instead.
                # Offloaded shards live on the CPU (FSDP2 refuses them elsewhere).
                model.to_empty(device="cpu" if self.cpu_offload else self.root_device)
                self._init_shards(model)
        else:
            # Sharded by an earlier run of this trainer (``validate`` before ``fit``): FSDP2 keeps the
            # root unit gathered after a forward without backward, so its parameters are the full
            # tensors now, and an optimizer built on them would step copies that training never touches.
            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()
        super().setup(trainer)

    @override
    def model_to_device(self) -> None:
        """Move the module to the root device; offloaded parameter shards stay on the CPU.

        Lightning moves the whole module; under ``cpu_offload`` that would move FSDP2's sharded
        parameters too, which it refuses, so every tensor but those (buffers, parameters that no
        unit shards) moves instead.
        """
        if not self.cpu_offload:
            super().model_to_device()
            return
        assert self.model is not None
        device = self.root_device
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
            for param in module._parameters.values():
                if param is not None and not isinstance(param, DTensor):
                    param.data = param.data.to(device)

    @override
    def _get_process_group_backend(self) -> str:
        """Lightning's backend for the root device; under ``cpu_offload`` on an accelerator, with gloo for the CPU shards."""
        backend = super()._get_process_group_backend()
        if self.cpu_offload and self._process_group_backend is None and self.root_device.type != "cpu":
            return f"{self.root_device.type}:{backend},cpu:gloo"
        return backend

    def _init_shards(self, model: LoopedLM) -> None:
        """Run ``model.init_weights()`` on the materialised shards.

        On CUDA-like meshes DTensor draws every shard from one stream shared by the ranks. It has no
        such support for CPU tensors (a CPU mesh, or shards offloaded to the CPU): each rank would
        draw its shard from the same generator state, so all shards would be equal. There each rank
        draws from its own seed (``initial_seed + rank``), leaving the global generator as it was.
        """
        mesh = self.device_mesh["data_parallel"]
        if mesh.device_type != "cpu" and not self.cpu_offload:
            model.init_weights()
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch.initial_seed() + mesh.get_local_rank())
            model.init_weights()

    def _require_loop_independent_parameters(self, model: LoopedLM) -> None:
        dependent = loop_dependent_parameters(model, range(1, model.config.max_loops + 1))
        if dependent:
            listed = ", ".join(f"{name} (unused at k={ks})" for name, ks in list(dependent.items())[:3])
            raise ValueError(
                f"{type(self).__name__}: {len(dependent)} parameter(s) take part at some loop counts only: {listed}. "
                "Ranks at different k would reduce-scatter different gradients and abort or hang. Use them at "
                "every k (multiply by a zero gate instead of skipping) or set reduce_scatter_unused_params: true"
            )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        group = self.device_mesh["data_parallel"].get_group()
        verify_loop_schedule(self, self.check_schedule_every_n_steps, group=group)
        return super().training_step(*args, **kwargs)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint, optimizer state only for the parameters that had some when it was written.

        Before the delayed switch the conditioning heads have no AdamW state (no gradient yet), so the
        checkpoint holds none for them. Lightning's loader gives every parameter of the fresh optimizer
        state (torch's ``get_optimizer_state_dict``) and then demands all of it from the checkpoint:
        resuming failed with ``Missing key ... conditioner.mlp.0.weight.step`` (sharded) or ``Missing
        optimizer state for parameter`` (full). Here the parameters without saved state end without
        state, as in the run that wrote the checkpoint, so the resumed run continues exactly. The
        model's weights and the metadata load as in Lightning, as data: ``weights_only`` is ``True``
        unless given, a pickled object is refused in one line, a sharded folder's index is checked
        before torch unpickles it, and its shards are read as data (:mod:`elr_lightning.checkpoints.safe_load`;
        Lightning's own sharded load lets torch unpickle their non-tensor entries).
        """
        path = Path(self.broadcast(checkpoint_path))
        assert self.lightning_module is not None
        module = self.lightning_module
        weights_only = True if weights_only is None else weights_only
        if weights_only and _is_sharded_checkpoint(path):
            check_sharded_folder(str(path), "--ckpt_path")
            state = {"state_dict": get_model_state_dict(self.model)}
            load_sharded(state, str(path))
            self.model.load_state_dict(state["state_dict"], strict=module.strict_loading)
            checkpoint = read_sharded_meta(str(path), check_config=False)
        else:
            with refusing_pickles(str(path)):
                checkpoint = _load_checkpoint(
                    path=path, state={"state_dict": self.model}, strict=module.strict_loading, weights_only=weights_only
                )
        for idx, optimizer in enumerate(self.optimizers):
            if _is_sharded_checkpoint(path):
                self._load_sharded_optimizer_state(path, f"optimizer_{idx}", optimizer)
            else:
                self._load_full_optimizer_state(checkpoint["optimizer_states"][idx], optimizer)
        return checkpoint

    def _load_sharded_optimizer_state(self, path: Path, key: str, optimizer: torch.optim.Optimizer) -> None:
        """Load ``optimizer``'s state saved under ``key`` in the checkpoint folder ``path``.

        The checkpoint's flattened keys read ``<key>.state.<parameter name>.<state name>``; torch's
        layout asks for every parameter's state, so it is cut down to the parameters saved with state.
        """
        prefix = f"{key}.state."
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        saved = {name[len(prefix) :].rsplit(".", 1)[0] for name in stored if name.startswith(prefix)}
        layout = get_optimizer_state_dict(self.model, optimizer)
        layout["state"] = {name: state for name, state in layout["state"].items() if name in saved}
        wrapped = {key: layout}
        load_sharded(wrapped, str(path))
        # The optimizer's ``load_state_dict`` replaces its whole state, so the placeholder state that
        # ``get_optimizer_state_dict`` created for the unsaved parameters goes; strict=False lets it.
        options = StateDictOptions(cpu_offload=True, strict=False)
        set_optimizer_state_dict(self.model, optimizer, optim_state_dict=wrapped[key], options=options)

    def _load_full_optimizer_state(self, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Load ``optimizer``'s state from a full (single-file) checkpoint's ``optimizer_states`` entry.

        torch keeps its placeholder state for parameters the checkpoint has none for; it is dropped.
        """
        saved = _rekey_optimizer_state_if_needed(saved, self.model)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_optimizer_state_dict(self.model, optimizer, optim_state_dict=saved, options=options)
        named = self.model.named_parameters(remove_duplicate=False)
        with_state = {id(param) for name, param in named if name in saved["state"]}
        for param in [param for param in optimizer.state if id(param) not in with_state]:
            del optimizer.state[param]

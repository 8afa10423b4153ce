"""Trainer callbacks of the ELR recipe: delayed mixed depth, zero-init heads, eq. (5) accounting, safe
checkpoints, TensorBoard loop plots, depth-task accuracy, throughput and MFU, a progress bar for step-limited runs."""

from elr_lightning.callbacks.atomic_checkpoint import AtomicModelCheckpoint
from elr_lightning.callbacks.compute_accounting import ComputeAccounting
from elr_lightning.callbacks.delayed_mixed_depth import DelayedMixedDepth, DelayedSampler
from elr_lightning.callbacks.depth_accuracy import DepthAccuracy
from elr_lightning.callbacks.exclusive_save_config import ExclusiveSaveConfig
from elr_lightning.callbacks.loop_plots import LoopCountPlots
from elr_lightning.callbacks.step_progress_bar import StepProgressBar
from elr_lightning.callbacks.throughput import TrainingThroughput
from elr_lightning.callbacks.zero_init_conditioning import ZeroInitConditioning

__all__ = [
    "AtomicModelCheckpoint",
    "ComputeAccounting",
    "DelayedMixedDepth",
    "DelayedSampler",
    "DepthAccuracy",
    "ExclusiveSaveConfig",
    "LoopCountPlots",
    "StepProgressBar",
    "TrainingThroughput",
    "ZeroInitConditioning",
]

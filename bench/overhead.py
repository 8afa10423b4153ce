"""Train-step cost of ELR against the non-recurrent baseline, and of each loop count against eq. (1).

Every figure is measured in the same run, with the configurations interleaved round by round (the
order rotates each round) so that drift on a noisy machine hits them alike. A ratio is taken within
each round (one step of each configuration, back to back) and reported as the median over rounds
with its range; step times are medians over rounds. Each step is timed twice: wall clock, and the
process's CPU time, which on a machine shared with other processes counts only this process's
work (with one thread, ``OMP_NUM_THREADS=1``, it is the step's cost; with more threads it sums
them). The load average is printed before and after.

Beside the baseline, the ELR model with the gate of eq. (2) alone, and the conditioned model at each
k, two rows separate what each part costs: the conditioned model with its conditioning switched off
(the same parameters and allocations; on / off is eq. 4's cost alone) and a second copy of the
baseline (its ratio to the baseline is the noise floor: two identical models differ by where their
memory lies).

    python bench/overhead.py                       # prints a table, writes bench/results/overhead.json
    python bench/overhead.py --precision bf16 --d_model 512

Direct use of ``LoopedLM`` with a default ``LoopConditioner()`` at k = 1 against a plain model of the
same 4 layers (the case of issue 23: d = 256, 1/2/1 layers, d_ff = 1024, batch 8 x 256, fp32)::

    python bench/overhead.py --layers 1 2 1 --d_ff 1024 --short

The conditioning target (<= 1.03x) is meant at d = 512 and 8,192 tokens per step, eager and with
the whole looped forward compiled (``--compile model``; ``--compile both`` times the eager and the
compiled copy of every case in the same rounds and prints compiled over eager)::

    python bench/overhead.py --d_model 512 --n_heads 8 --layers 1 2 1 --batch 32 --short --compile both
    python bench/overhead.py --arch moe --d_model 128 --layers 1 2 1 --short --compile both

``--copies_kept`` adds the conditioned model at k = 1 with eq. 4's folded weights kept for the
backward pass instead of rebuilt in it (the library's form before issue 33), in the same rounds:
its ratio is what rebuilding them costs.

Every model steps with the library's AdamW (:func:`elr_lightning.optim.adamw`: torch's fused kernel);
``--optimizer for-loop`` uses torch's per-tensor update instead (its CPU default, what the step paid
before). ``--count_ops`` counts the aten ops of one eager step of each model after the timed rounds
(the per-step fixed cost no FLOP count shows)::

    python bench/overhead.py --layers 1 2 1 --d_ff 1024 --max_loops 1 --count_ops

``--arch hybrid`` is the hybrid quickstart's pattern (GatedDeltaProduct in, GDP and attention shared, attention out); ``--arch moe`` makes every
channel mixer a top-2-of-8 mixture of experts of the dense d_ff's active width. ``--short`` keeps
the baseline, its copy (the noise floor) and the conditioned model at k = 1 and K.

Targets (issue: foundation): ELR at k = 1 within 1.03x of the baseline; step time at k over step
time at k = 1 within 1.00 +- 0.05 of D_eff(k) / D_eff(1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from elr_lightning.conditioning import LoopConditioner
from elr_lightning.config import ModelConfig
from elr_lightning.model import LoopedLM
from elr_lightning.optim import adamw, param_groups

#: ``--arch``: the mixers of every layer besides the defaults (attention, SwiGLU).
ARCHS = {
    "attention": {},
    "hybrid": {"token_pattern": {"in": ["gdp"], "rec": ["gdp", "attention"], "out": ["attention"]},
               "mixers": {"gdp": {"class_path": "elr_lightning.mixers.GatedDeltaProduct"}}},
    "moe": {"channel_pattern": ["moe"], "mixers": {"moe": {"class_path": "elr_lightning.mixers.MoE"}}},
}  # fmt: skip


def arch_fields(arch: str, d_model: int, n_heads: int, d_ff: int | None = None) -> dict:
    """``ModelConfig`` fields of ``--arch`` beyond the sizes (:data:`ARCHS`; the MoE's experts sized to the dense FLOPs)."""
    extra = dict(ARCHS[arch])
    if arch == "moe":  # top-2 of 8 experts of half the dense width: the dense model's active FLOPs
        dense = d_ff or ModelConfig(d_model=d_model, n_heads=n_heads).ff_dim
        moe = {"num_experts": 8, "top_k": 2, "expert_dim": dense // 2}
        extra["mixers"] = {"moe": {**extra["mixers"]["moe"], "init_args": moe}}
    return extra


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (views included): the per-step fixed cost that no FLOP count shows."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def eq4_copies_kept() -> Iterator[None]:
    """Eq. 4's folded weights kept for the backward pass, as before issue 33: ``RecomputedTensors`` switched off."""
    from elr_lightning import conditioning, recompute
    from elr_lightning.mixers import base

    class Off(recompute.RecomputedTensors):
        def __init__(self, enabled: bool) -> None:
            super().__init__(False)

    saved = base.RecomputedTensors, conditioning.RecomputedTensors
    base.RecomputedTensors = conditioning.RecomputedTensors = Off
    try:
        yield
    finally:
        base.RecomputedTensors, conditioning.RecomputedTensors = saved


def make_step(
    model,
    batch: torch.Tensor,
    loops: int,
    precision: str,
    conditioning: bool = True,
    source: LoopedLM | None = None,
    optimizer: str = "default",
    copies_kept: bool = False,
):
    source = model if source is None else source
    groups = param_groups(source, 0.1)
    # default: the library's (elr_lightning.optim.adamw: fused); for-loop: torch's per-tensor update on the CPU
    opt = adamw(groups, lr=1e-4) if optimizer == "default" else torch.optim.AdamW(groups, lr=1e-4, foreach=False)
    autocast = (
        torch.autocast(batch.device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    )

    def step() -> tuple[float, float]:
        if source.conditioner is not None:
            source.conditioner.set_active(conditioning)
        start, start_cpu = time.perf_counter(), time.process_time()
        with eq4_copies_kept() if copies_kept else nullcontext():
            with autocast:
                logits = model(batch[:, :-1], loops)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.process_time() - start_cpu

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d_model", type=int, default=256)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--layers", type=int, nargs=3, default=[2, 4, 2], metavar=("N_IN", "N_REC", "N_OUT"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--max_loops", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="attention")
    parser.add_argument("--d_ff", type=int, default=None, help="SwiGLU width (default 8/3 d)")
    parser.add_argument("--compile", choices=["none", "layers", "model", "both"], default="none",
                        help="layers: every layer (compile_layers); model: the whole looped forward "
                             "(compile_model); both: eager and compiled-model copies of every case")
    parser.add_argument("--short", action="store_true",
                        help="only the baseline (and its copy, the noise floor) and the conditioned model at k = 1 and K")
    parser.add_argument("--optimizer", choices=["default", "for-loop"], default="default",
                        help="default: elr_lightning.optim.adamw (fused); for-loop: torch's per-tensor AdamW")
    parser.add_argument("--copies_kept", action="store_true",
                        help="also the conditioned model at k = 1 with eq. 4's folded weights kept for the backward "
                             "pass instead of rebuilt (as before issue 33), in the same rounds")
    parser.add_argument("--count_ops", action="store_true",
                        help="also count the aten ops of one eager step of each model (after the warm-up)")
    parser.add_argument("--out", default="bench/results/overhead.json")
    args = parser.parse_args()

    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    n_in, n_rec, n_out = args.layers
    cfg = ModelConfig(
        vocab_size=256, d_model=args.d_model, n_heads=args.n_heads, n_in=n_in, n_rec=n_rec, n_out=n_out,
        max_seq_len=args.seq_len, max_loops=args.max_loops, d_ff=args.d_ff,
        **arch_fields(args.arch, args.d_model, args.n_heads, args.d_ff),
    )
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1))
    baseline, gate_only, conditioned = LoopedLM.baseline(cfg), LoopedLM(cfg), LoopedLM(cfg, conditioner=LoopConditioner())
    if args.compile == "layers":
        for model in (baseline, gate_only, conditioned):
            for layer in [*model.input_layers, *model.core.layers, *model.output_layers]:
                layer.compile()
    elif args.compile == "model":
        for model in (baseline, gate_only, conditioned):
            model.compile()
    opt = args.optimizer
    cases = {
        "baseline k=1": make_step(baseline, batch, 1, args.precision, optimizer=opt),
        "baseline k=1 (a copy)": make_step(LoopedLM.baseline(cfg), batch, 1, args.precision, optimizer=opt),
    }
    if not args.short:
        cases["elr k=1 (gate only)"] = make_step(gate_only, batch, 1, args.precision, optimizer=opt)
        cases["elr k=1 (conditioning off)"] = make_step(
            conditioned, batch, 1, args.precision, conditioning=False, optimizer=opt
        )
    for k in range(1, cfg.max_loops + 1) if not args.short else sorted({1, cfg.max_loops}):
        cases[f"elr k={k} (conditioned)"] = make_step(conditioned, batch, k, args.precision, optimizer=opt)
    if args.copies_kept:
        cases["elr k=1 (conditioned, copies kept)"] = make_step(
            conditioned, batch, 1, args.precision, optimizer=opt, copies_kept=True
        )
    if args.compile == "both":  # the same models' weights, through torch.compile of the whole forward
        compiled = {id(m): torch.compile(m) for m in (baseline, conditioned)}
        for name in list(cases):
            model = baseline if name.startswith("baseline") and "copy" not in name else conditioned
            if "copy" in name or "gate only" in name or "kept" in name:
                continue
            k = int(name.split("k=")[1].split()[0])
            cases[f"{name} compiled"] = make_step(
                compiled[id(model)], batch, k, args.precision, conditioning="off" not in name, source=model,
                optimizer=opt,
            )

    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in cases}
    cpu_times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(args.warmup + args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            wall, cpu = cases[name]()
            if r >= args.warmup:
                times[name].append(wall)
                cpu_times[name].append(cpu)
    load_after = os.getloadavg()
    ops = {}
    if args.count_ops:  # one more eager step of each case at k = 1 under a dispatch counter
        for name in (n for n in names if "k=1" in n and not n.endswith("compiled")):
            with OpCounter() as counter:
                cases[name]()
            ops[name] = counter.ops
    median = {name: statistics.median(ts) for name, ts in times.items()}

    def per_round(name: str, clock: dict[str, list[float]] = times, base: str = "baseline k=1") -> dict[str, float]:
        ratios = [t / b for t, b in zip(clock[name], clock[base])]
        return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}

    rows = []
    print(f"{'case':<36}{'ms/step':>10}{'vs baseline':>13}{'cpu vs base':>13}{'vs k=1':>9}{'D_eff pred':>12}"
          f"{'meas/pred':>11}{'compiled/eager cpu':>20}")
    for name, t in median.items():
        suffix = " compiled" if name.endswith(" compiled") else ""
        base = "baseline k=1" + suffix
        row = {
            "case": name, "ms_per_step": 1e3 * t, "cpu_ms_per_step": 1e3 * statistics.median(cpu_times[name]),
            "ratio_vs_baseline": per_round(name, times, base)["median"],
            "cpu_ratio_vs_baseline": per_round(name, cpu_times, base)["median"],
            "wall_s": times[name], "cpu_s": cpu_times[name],
        }
        if "conditioned" in name:
            k = int(name.split("k=")[1].split()[0])
            k1 = median["elr k=1 (conditioned)" + suffix]
            predicted = cfg.effective_depth(k) / cfg.effective_depth(1)
            row.update(loops=k, ratio_vs_k1=t / k1, predicted_ratio=predicted, measured_over_predicted=t / k1 / predicted)
        if suffix:
            row["cpu_compiled_over_eager"] = per_round(name, cpu_times, name[: -len(suffix)])
        rows.append(row)
        extra = (
            f"{row['ratio_vs_k1']:>9.3f}{row['predicted_ratio']:>12.3f}{row['measured_over_predicted']:>11.3f}"
            if "loops" in row else " " * 32
        )
        if suffix:
            c = row["cpu_compiled_over_eager"]
            extra += f"{c['median']:>10.3f} ({c['min']:.2f}-{c['max']:.2f})"
        print(f"{name:<36}{1e3 * t:>10.1f}{row['ratio_vs_baseline']:>13.3f}{row['cpu_ratio_vs_baseline']:>13.3f}{extra}")
    if ops:
        print("\naten ops per eager step (forward, loss, backward, optimizer):")
        models = {"baseline": baseline, "gate only": gate_only, "conditioned": conditioned, "conditioning off": conditioned}
        for name, n in ops.items():
            model = next((m for key, m in models.items() if key in name), baseline)
            print(f"  {name:<36}{n:>7,} ops{len(list(model.parameters())):>5} parameter tensors")
    result = {
        "config": vars(args),
        "aten_ops_per_step": ops,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rows": rows,
        "load_average_before": load_before,
        "load_average_after": load_after,
    }
    ratios = {  # key: (case, base case)
        "elr_k1_gate_only_over_baseline": ("elr k=1 (gate only)", "baseline k=1"),
        "elr_k1_conditioned_over_baseline": ("elr k=1 (conditioned)", "baseline k=1"),
        "elr_k1_conditioned_over_baseline_compiled": ("elr k=1 (conditioned) compiled", "baseline k=1 compiled"),
        "baseline_copy_over_baseline": ("baseline k=1 (a copy)", "baseline k=1"),
        "conditioning_on_over_off": ("elr k=1 (conditioned)", "elr k=1 (conditioning off)"),
        "copies_rebuilt_over_kept": ("elr k=1 (conditioned)", "elr k=1 (conditioned, copies kept)"),
        "copies_kept_over_baseline": ("elr k=1 (conditioned, copies kept)", "baseline k=1"),
    }
    print(f"\nper-round ratios over {args.rounds} rounds: median (range); target <= 1.03 for conditioned k = 1")
    for key, (name, base) in ratios.items():
        if name in cases and base in cases:
            wall, cpu = per_round(name, times, base), per_round(name, cpu_times, base)
            result[key], result[f"{key}_cpu"] = wall, cpu
            print(f"  {name} / {base}: wall {wall['median']:.3f} ({wall['min']:.3f}-{wall['max']:.3f})"
                  f"   cpu {cpu['median']:.3f} ({cpu['min']:.3f}-{cpu['max']:.3f})")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

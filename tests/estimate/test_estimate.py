"""``elr estimate``: the per-rank peak of a training step traced on fake tensors, against the same step on real ones.

The check against reality runs each quickstart config's model at a small size through the same
training step twice: on fake tensors from a meta-device build (the estimate) and on real tensors
(torch's ``MemTracker`` on the real step, :func:`~elr_lightning.estimate.measured_steps`); the two
agree to a few KiB, except where a mixture of experts routes real tokens unevenly. The bench
``bench/estimate.py`` repeats it at the configs' own size against the process's resident memory.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elr_lightning.estimate import fit as estimate_fit
from elr_lightning.estimate import report as estimate_report
from elr_lightning.estimate import target as estimate_target
from elr_lightning.cli import main
from elr_lightning.core import CHECKPOINTING
from elr_lightning.estimate.memory import (
    Setting,
    StepMemory,
    Target,
    ddp_bucket_bytes,
    estimate_steps,
    fake_mode,
    fake_process_group,
    fake_training,
    measured_steps,
    offload_copy_bytes,
    primed_optimizer,
)
from elr_lightning.estimate.fit import log_fit_estimate
from elr_lightning.estimate.hardware import DEFAULT_DEVICE_MEMORY, detected_device_memory, parse_memory
from elr_lightning.estimate.report import memory_report
from elr_lightning.estimate.search import largest_fitting
from elr_lightning.estimate.trackers import FSDPStepTracker
from elr_lightning.lightning_cli import build_module, merged_config
from elr_lightning.module import ELRModule
from elr_lightning.strategies import shard_looped_lm

ROOT = Path(__file__).resolve().parents[2]
QUICKSTARTS = ("quickstart.yaml", "quickstart_hybrid.yaml", "quickstart_moe.yaml")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: per-op latency, not arithmetic


def _config(name: str) -> dict:
    return merged_config(str(ROOT / "config" / name))


def _small(name: str) -> dict:
    """A quickstart config at a test's size: the same layers, mixers and eq. 4, narrower, in one shard."""
    config = _config(name)
    config["model"]["init_args"]["arch"]["d_model"] = 64
    config["model"]["init_args"]["virtual_ranks"] = 1
    return config


def _real_module(config: dict) -> ELRModule:
    torch.manual_seed(0)
    return ELRModule(**config["model"]["init_args"])


#: How far the fake trace may be from torch's tracker on the real step: dense and hybrid layers allocate the
#: same tensors on fake and real tensors (measured: 1 KiB less, at every k and mode); a mixture of experts
#: routes fake tokens evenly where real ones are not (measured: 0.11 to 1.5 MiB more of 22 to 27 MiB, 0.4-7%).
EXACT_BYTES = 4 * 2**10
MOE_OVER = 0.08


@pytest.mark.slow
@pytest.mark.parametrize("name", QUICKSTARTS)
def test_the_estimate_equals_the_real_steps_peak(name: str) -> None:
    config = _small(name)
    k_max = config["model"]["init_args"]["arch"]["max_loops"]
    quick = name == "quickstart.yaml"  # every mode at k = 1 and K, truncated backprop and accumulation, on one config
    cases = [(k, mode, None) for k in ((1, k_max) if quick else (k_max,)) for mode in CHECKPOINTING]
    cases += [(k_max, "none", 1)] if quick else [(1, "none", None)]
    settings = [Setting(k, mode, backprop, 2, 16) for k, mode, backprop in cases]
    peaks = {}
    for accumulate in (1, 2) if quick else (1,):
        target = Target("single", 1, "32-true", accumulate_grad_batches=accumulate)
        estimated = estimate_steps(lambda: build_module(config), target, settings)
        measured = measured_steps(_real_module(config), target, settings)
        for setting, guess, truth in zip(settings, estimated, measured):
            if "moe" in name:
                assert 0 <= guess.peak - truth.peak <= MOE_OVER * truth.peak, (setting, guess, truth)
            else:
                assert abs(guess.peak - truth.peak) <= EXACT_BYTES, (setting, guess, truth)
            assert guess.params == truth.params and guess.optimizer == truth.optimizer, setting
        peaks[accumulate] = {(s.loops, s.label): m.peak for s, m in zip(settings, estimated)}
    one = peaks[1]
    assert one[(k_max, "none")] > one[(1, "none")]  # activations grow with k without checkpointing
    assert one[(k_max, "loop")] < one[(k_max, "none")] and one[(k_max, "layer")] < one[(k_max, "none")]
    if quick:  # the first micro-batch's gradients stay alive through the second
        assert all(peaks[2][key] > peak for key, peak in one.items())


@pytest.mark.slow
def test_fsdp_shards_parameters_and_optimizer_state_and_ddp_adds_its_buckets() -> None:
    config = _small("quickstart.yaml")
    setting = Setting(2, "loop", None, 2, 16)
    build = lambda: build_module(config)  # noqa: E731
    single, = estimate_steps(build, Target("single"), [setting])
    with fake_training(build, Target("fsdp", 4, gradient_clip_val=1.0)) as trace:
        # DTensor derives an op's layout on global-shape fake tensors the first time only: the
        # optimizer is primed so that the first traced step does not count them
        sharded, again = trace(setting), trace(setting)
    assert sharded == again
    ddp, = estimate_steps(build, Target("ddp", 8), [setting])
    in_buckets, = estimate_steps(build, Target("ddp", 8, gradient_as_bucket_view=True), [setting])
    # FSDP2 pads every shard to an equal size: a quarter, give or take a row per tensor
    assert sharded.optimizer == pytest.approx(single.optimizer / 4, rel=0.02)
    # each layer its own unit: at the peak a layer or two are gathered (twice: all-gather buffer and copy-out),
    # which at this size outweighs the parameters that sharding saves; gradients and the peak shrink
    assert sharded.grads < single.grads and sharded.peak < single.peak
    buckets = ddp_bucket_bytes(build().model)
    assert ddp.grads == single.grads + buckets
    assert in_buckets.grads == buckets
    assert ddp.activations == single.activations and ddp.optimizer == single.optimizer


def _padded_shard_bytes(model: torch.nn.Module, ranks: int) -> list[int]:
    """Rank 0's shard of each fp32 parameter as FSDP2 cuts it: dim 0 in ``ranks`` equal chunks, the first padded."""
    return [-(-p.shape[0] // ranks) * math.prod(p.shape[1:]) * 4 for p in model.parameters()]


@pytest.mark.slow
def test_cpu_offload_moves_shards_gradients_and_optimizer_state_to_the_host() -> None:
    """The same step traced with FSDP2's CPU offload: the device keeps the gathered units and the activations, the host
    the shards, their gradients and AdamW's state (to a few bytes without clipping, whose norms are the host's too), and
    on an accelerator pinning rounds each shard and gradient shard up to a power of two."""
    config = _small("quickstart_hybrid.yaml")
    setting = Setting(2, "layer", None, 2, 16)
    build = lambda: build_module(config)  # noqa: E731
    kept, = estimate_steps(build, Target("fsdp", 4), [setting])
    offloaded, = estimate_steps(build, Target("fsdp", 4, cpu_offload=True), [setting])
    pinned, = estimate_steps(build, Target("fsdp", 4, cpu_offload=True, accelerator="cuda"), [setting])
    clipped, = estimate_steps(build, Target("fsdp", 4, gradient_clip_val=1.0, cpu_offload=True), [setting])
    shards = _padded_shard_bytes(build_module(config).model, 4)
    assert offloaded.optimizer == 0 and offloaded.activations == kept.activations
    state = kept.optimizer + 2 * sum(shards)  # AdamW's state, the parameter and gradient shards
    assert 0 <= offloaded.host - state <= 64  # measured: 4 bytes more, a scalar of the fused step
    assert 0 < clipped.host - offloaded.host < 0.01 * offloaded.host  # clipping on the host: a norm per tensor
    assert offloaded.peak < kept.peak
    # splitting the step's memory in two creates none: at any moment device + host <= both peaks
    assert kept.peak <= offloaded.peak + offloaded.host
    rounding = sum((1 << (b - 1).bit_length()) - b for b in shards)
    assert pinned.host - offloaded.host == 2 * rounding > 0  # rank 0's shard and gradient shard, each pinned
    assert pinned.peak == offloaded.peak


def test_the_offloaded_gather_copy_is_the_largest_units_shards() -> None:
    """What FSDP2 copies to the device before an offloaded all-gather: one unit's shards (the parameters it owns and
    no unit inside it owns), the largest of them."""
    from torch.distributed.fsdp import FSDPModule

    with fake_process_group(4) as mesh:
        module = build_module(_small("quickstart.yaml"))
        with fake_mode():
            shard_looped_lm(module.model, mesh, cpu_offload=True)
            module.model.to_empty(device="cpu")
            owned = []
            for unit in (m for m in module.model.modules() if isinstance(m, FSDPModule)):
                inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
                params = [p for p in unit.parameters() if id(p) not in inner]
                owned.append(sum(-(-p.shape[0] // 4) * math.prod(p.shape[1:]) * 4 for p in params))
            assert offload_copy_bytes(module.model) == max(owned) > 0


def test_clipping_sharded_gradients_counts_no_global_copies() -> None:
    """DTensor derives an op's output layout the first time it meets it, on fake tensors of the global shapes in
    the active fake mode, where the tracker would count them: clipping 8 shards would add 8 shards' worth of
    gradients per rank. The primed optimizer has clipped once already, so a traced clip adds only the norms."""
    config = _config("quickstart.yaml")
    with fake_process_group(8) as mesh:
        module = build_module(config)
        with fake_mode():
            shard_looped_lm(module.model, mesh)
            module.model.to_empty(device="cpu")
            optimizer = primed_optimizer(module, gradient_clip_val=1.0)
            for p in module.model.parameters():
                p.grad = torch.zeros_like(p)
            tracker = FSDPStepTracker(module.model, optimizer)
            with tracker:
                before = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
                torch.nn.utils.clip_grad_norm_(module.model.parameters(), 1.0)
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    global_grads = 4 * sum(p.numel() for p in module.model.parameters())
    assert peak - before < 0.01 * global_grads, (peak - before, global_grads)


def test_precision_sets_the_dtypes_of_weights_and_state() -> None:
    config = _small("quickstart.yaml")
    setting = Setting(1, "layer", None, 1, 8)
    fp32, = estimate_steps(lambda: build_module(config), Target("single", 1, "32-true"), [setting])
    bf16, = estimate_steps(lambda: build_module(config), Target("single", 1, "bf16-true"), [setting])
    mixed, = estimate_steps(lambda: build_module(config), Target("single", 1, "bf16-mixed"), [setting])
    assert bf16.params == fp32.params // 2 and bf16.optimizer < fp32.optimizer
    assert mixed.params == fp32.params and mixed.optimizer == fp32.optimizer  # fp32 master weights and state


@given(
    intercept=st.integers(0, 10_000),
    slope=st.integers(1, 1_000),
    curve=st.integers(0, 3),
    budget=st.integers(0, 200_000),
    start=st.integers(1, 300),
    minimum=st.integers(1, 4),
)
def test_largest_fitting_finds_the_boundary_of_any_growing_peak(intercept, slope, curve, budget, start, minimum):
    def peak(b: int) -> int:
        return intercept + slope * b + curve * b * b

    calls = []
    found = largest_fitting(lambda b: calls.append(b) or peak(b), budget, start, minimum, limit=1000)
    fitting = [b for b in range(minimum, 1001) if peak(b) <= budget]
    assert found == (max(fitting) if fitting else None)
    assert len(set(calls)) == len(calls)  # no size is traced twice


def test_the_device_memory_is_this_machines_and_says_where_it_comes_from(monkeypatch) -> None:
    """A CPU config is estimated against this machine's RAM; a GPU config without a GPU here against 80 GB, said so."""
    import os

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert detected_device_memory("cpu") == (ram, "this machine's RAM (trainer.accelerator cpu)")
    assert detected_device_memory(None)[0] == ram  # auto, no GPU: the run would be on the CPU
    memory, source = detected_device_memory("gpu")
    assert memory == DEFAULT_DEVICE_MEMORY and source.startswith("assumed") and "--device_memory" in source


@given(peaks=st.sampled_from(["convex", "concave", "step"]), budget=st.integers(10**5, 10**9), start=st.integers(1, 64))
def test_the_search_needs_few_probes_whatever_the_peaks_shape(peaks: str, budget: int, start: int) -> None:
    """At most about 3 log2(limit) probes: the straight-line search alone crept, up to 210 probes on such peaks."""
    peak = {
        "convex": lambda b: 460_826 + 161 * b + 50 * b * b,
        "concave": lambda b: 1000 + int(30_000 * b**0.5),
        "step": lambda b: 1000 + 500 * b + (10**6 if b > 500 else 0),
    }[peaks]
    calls: list[int] = []
    largest_fitting(lambda b: calls.append(b) or peak(b), budget, start, 1, limit=1 << 16)
    assert len(calls) <= 3 * 16


@pytest.mark.parametrize(
    "text, expected",
    [("80GB", 80 * 10**9), ("79.5 GiB", int(79.5 * 2**30)), ("512MiB", 512 * 2**20), ("1e9B", 10**9), ("2tb", 2 * 10**12)],
)
def test_parse_memory(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["80", "eighty GB", "-1GB", "0GB", "80 GBs", ""])
def test_parse_memory_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="--device_memory .* give a number and a unit"):
        parse_memory(text)


BAD_FLAGS = {
    "devices": (["--devices", "0"], "--devices 0 must be an integer >= 1"),
    "num_nodes": (["--num_nodes", "-2"], "--num_nodes -2"),
    "memory": (["--device_memory", "80"], "--device_memory '80' is not a memory size"),
    "strategy": (["--strategy", "zero3"], "--strategy 'zero3' must be one of"),
    "mode": (["--modes", "none,fast"], "--modes 'fast' is not a mode"),
    "micro_batch": (["--micro_batch", "2"], "smaller than model.init_args.virtual_ranks=4"),
    "headroom": (["--headroom", "1.5"], "--headroom 1.5 must be in [0, 1)"),
    "offload": (["--cpu_offload"], "--cpu_offload is FSDP2's and this run is single; pass --strategy fsdp too"),
    "host_memory": (["--strategy", "fsdp", "--cpu_offload", "--host_memory", "2T"], "--host_memory '2T' is not a memory size"),
    "model": (["--config", "BROKEN"], "the model cannot be built: arch.d_model=30 is not divisible by arch.n_heads=4"),
}


@pytest.mark.parametrize("name", sorted(BAD_FLAGS))
def test_a_bad_flag_is_one_line_naming_it(name: str, tmp_path: Path, capsys, monkeypatch) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  init_args:\n    arch: {d_model: 30, n_heads: 4}\n")
    flags, message = BAD_FLAGS[name]
    flags = [str(broken) if flag == "BROKEN" else flag for flag in flags]
    monkeypatch.delenv("ELR_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--config", str(ROOT / "config" / "quickstart.yaml"), "--seq_len", "8", *flags])
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("elr estimate: error:")]
    assert exit_info.value.code == 1
    assert len(said) == 1 and message in said[0], said


@pytest.mark.slow
def test_the_report_has_a_row_per_k_and_mode_and_a_verdict(tmp_path: Path, capsys) -> None:
    one_shard = tmp_path / "one_shard.yaml"
    one_shard.write_text("model:\n  init_args:\n    virtual_ranks: 1\n")
    configs = ["--config", str(ROOT / "config" / "quickstart.yaml"), "--config", str(one_shard)]
    main([
        "estimate", *configs, "--micro_batch", "4", "--seq_len", "16",
        "--modes", "none,layer", "--loops", "1,3", "--device_memory", "40MiB", "--headroom", "0", "--json",
    ])
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [(row["loops"], row["mode"]) for row in report["rows"]] == [(1, "none"), (1, "layer"), (3, "none"), (3, "layer")]
    for row in report["rows"]:
        assert row["peak"] == row["params"] + row["grads"] + row["optimizer"] + row["activations"]
    largest = report["largest_micro_batch"]
    assert largest is not None and largest >= 4 and report["configured"]["peak"] <= report["budget"]
    too_big = memory_report(
        configs[1::2], micro_batch=largest + 1, seq_len=16, loops=[3], modes=["none"],
        device_memory="40MiB", headroom=0, search=False,
    )
    assert too_big["configured"]["peak"] > too_big["budget"]
    assert too_big["verdict"].startswith("does not fit") and report["verdict"].startswith("fits")
    assert "elr estimate: k=3 none micro-batch 4" in err  # progress, one line per traced step


def _synthetic_steps(monkeypatch, host_gib: float = 20.0) -> list[Setting]:
    """Replace the traced step of :func:`memory_report` by a formula (GiB): 10 + micro-batch x (6k under ``none``,
    8 + 3k under ``loop``, 15 under ``layer``), with ``host_gib`` offloaded; returns the settings it was asked for."""
    asked: list[Setting] = []

    def step(setting: Setting) -> StepMemory:
        asked.append(setting)
        k, label = setting.loops, setting.label
        per_sequence = {"none": 6 * k, "loop": 8 + 3 * k, "layer": 15}[label]
        return StepMemory(10 * 2**30, 0, 0, setting.micro_batch * per_sequence * 2**30, int(host_gib * 2**30))

    @contextlib.contextmanager
    def fake(build, target, phases=False, prior_grads=False, replay=False):  # noqa: ANN001, ARG001 - the signature of fake_training
        yield (lambda setting: {"step": step(setting)}) if phases else step

    monkeypatch.setattr(estimate_report, "fake_training", fake)
    return asked


def test_the_verdict_names_a_fitting_mode_and_micro_batch_for_every_k(monkeypatch, tmp_path: Path) -> None:
    """At micro-batch 4 (budget 80 GB less 10%: 67.1 GiB): k = 1 and 2 fit without checkpointing, k = 3 and 4 fit
    nothing, and the lightest mode there (``layer``, 70 GiB) fits 3 sequences (55 GiB)."""
    asked = _synthetic_steps(monkeypatch)
    common = dict(devices=8, strategy="fsdp", accelerator="gpu", cpu_offload=True, device_memory="80GB",
                  micro_batch=4, seq_len=16, loops=[1, 2, 3, 4], modes=["none", "loop", "layer"])  # fmt: skip
    one_shard = tmp_path / "one_shard.yaml"
    one_shard.write_text("model:\n  init_args:\n    virtual_ranks: 1\n")
    quickstart = [str(ROOT / "config" / "quickstart.yaml"), str(one_shard)]
    report = memory_report(quickstart, host_memory="1TB", **common)
    assert report["headroom"] == 0.10 and report["headroom_source"].startswith("the default for a cuda device")
    fitting = [(e["loops"], e["mode"], e["micro_batch"]) for e in report["per_k"]]
    assert fitting == [(1, "none", 4), (2, "none", 4), (3, "layer", 3), (4, "layer", 3)]
    assert all(e["peak"] <= report["budget"] for e in report["per_k"])
    assert Setting(3, "layer", None, 2, 16) not in asked  # 3 is on the line through 1 and 4; 2 needs no trace
    text = estimate_report.format_memory_report(report)
    assert "less 10% headroom (the default for a cuda device" in text
    assert "per k: every k fits: k = 1 none at micro-batch 4 (34.0 GiB)" in text
    assert "k = 4 layer at micro-batch 3 (55.0 GiB)" in text
    assert "8 ranks x 20.0 GiB = 160 GiB per node (within 698 GiB, 75% of --host_memory)" in text
    assert report["verdict"].startswith("does not fit: the configured step (k = 3, none, micro-batch 4")
    small_host = memory_report(quickstart, host_memory="128GB", **common)  # 160 GiB of state, 89 GiB of RAM to hold it
    assert all(e["micro_batch"] is None for e in small_host["per_k"])
    assert small_host["per_k_verdict"].startswith("k = 1, 2, 3, 4 fit no mode and micro-batch")
    assert "(over 89 GiB, 75% of --host_memory)" in small_host["per_k_verdict"]
    cpu = memory_report(quickstart, **{**common, "accelerator": "cpu"})  # the host is the device there
    assert cpu["headroom"] == 0.25 and cpu["host_budget"] is None
    # 55.9 GiB for 10 + 20 GiB of host state + the step: none fits 2 sequences at k = 2, layer 1 at k = 3 and 4
    assert [(e["mode"], e["micro_batch"]) for e in cpu["per_k"]] == [("none", 4), ("none", 2), ("layer", 1), ("layer", 1)]
    assert "host memory" not in cpu["per_k_verdict"]


@pytest.mark.slow
def test_fit_logs_the_estimate_and_refuses_a_step_over_the_device_unless_told(tmp_path: Path, capsys, monkeypatch) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "seed_everything: 0\n"
        "trainer: {accelerator: cpu, devices: 1, max_steps: 1, logger: false, enable_checkpointing: false,\n"
        "  enable_progress_bar: false, enable_model_summary: false, limit_val_batches: 0,\n"
        f"  default_root_dir: {tmp_path / 'run'}}}\n"
        "model:\n  class_path: elr_lightning.ELRModule\n  init_args:\n"
        "    arch: {vocab_size: 256, d_model: 16, n_heads: 2, n_in: 1, n_rec: 1, n_out: 1, max_seq_len: 32, max_loops: 2}\n"
        "    sampler: {class_path: elr_lightning.sampling.OneLoopOverride, init_args: {max_loops: 2}}\n"
        "    warmup_steps: 1\n"
        "data:\n  class_path: elr_lightning.data.TextDataModule\n"
        f"  init_args: {{sources: [{tmp_path / 'corpus.txt'}], seq_len: 16, batch_size: 2, cache_dir: {tmp_path / 'cache'}}}\n"
    )
    (tmp_path / "corpus.txt").write_text("".join(f"line {i}: {i * 7919 % 1000}\n" for i in range(300)))
    queried = []

    def tiny_device(device: torch.device) -> int:  # the CPU posing as a 64 KiB GPU
        queried.append(device)
        return 2**16

    monkeypatch.setattr(estimate_fit, "cuda_total_memory", tiny_device)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(config)])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    refusals = [line for line in err.splitlines() if line.startswith("elr fit: error: the estimated peak")]
    assert len(refusals) == 1 and "exceeds 0.0 GiB" in refusals[0] and "--skip_memory_check trains anyway" in refusals[0], err
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").rglob("*.ckpt"))
    main(["fit", "--config", str(config), "--skip_memory_check", "true"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("elr: ")]
    assert len([line for line in lines if line.startswith("elr: estimated peak memory per rank")]) == 1, err
    warnings = [line for line in lines if line.startswith("elr: warning: the estimated peak")]
    assert len(warnings) == 1 and "training anyway (--skip_memory_check)" in warnings[0], err
    assert queried == [torch.device("cpu")] * 2


@pytest.mark.parametrize("mode", ["none", "layer"])
def test_fit_refuses_naming_the_smallest_change_that_fits(mode: str, capsys) -> None:
    """A device between the configured step and the next lighter one: the refusal names that one (lighter
    checkpointing under ``none``; under ``layer``, nothing is lighter: the largest micro-batch that fits)."""
    config = _small("quickstart.yaml")
    module = ELRModule(**{**config["model"]["init_args"], "activation_checkpointing": mode, "virtual_ranks": 1})
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    data = SimpleNamespace(batch_size=4, seq_len=16)
    peaks = estimate_steps(lambda: build_module(config), Target("single", 1, "32-true"), [
        Setting(3, mode, None, 4, 16), Setting(3, "loop", None, 4, 16), Setting(3, mode, None, 2, 16), Setting(3, mode, None, 3, 16),
    ])  # fmt: skip
    configured, lighter, half, three = (p.peak for p in peaks)
    target = (configured + lighter) // 2 if mode == "none" else (half + three) // 2
    with pytest.raises(estimate_fit.MemoryCheckFailed) as refused:
        log_fit_estimate(trainer, module, data, total_memory=lambda device: target, headroom=0.0)
    message = str(refused.value)
    assert "\n" not in message and message.endswith("--skip_memory_check trains anyway")
    if mode == "none":
        assert "--model.init_args.activation_checkpointing loop" in message
    else:
        assert "--data.init_args.batch_size 2 with --trainer.accumulate_grad_batches 2" in message
    assert capsys.readouterr().err.count("elr: estimated peak memory per rank") == 1
    assert log_fit_estimate(trainer, module, data, total_memory=lambda device: target, headroom=0.0, check=False) is not None
    assert "training anyway (--skip_memory_check)" in capsys.readouterr().err


def test_on_a_cpu_nothing_is_traced(capsys) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    module = _real_module(_config("quickstart.yaml"))
    data = SimpleNamespace(batch_size=16, seq_len=128)
    assert log_fit_estimate(trainer, module, data) is None
    assert capsys.readouterr().err == ""


def test_the_fit_estimate_is_the_runs_worst_step(capsys) -> None:
    config = _small("quickstart.yaml")
    module = ELRModule(**{**config["model"]["init_args"], "activation_checkpointing": "loop"})
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, gradient_clip_val=1.0)
    data = SimpleNamespace(batch_size=2, seq_len=16)
    roomy = log_fit_estimate(trainer, module, data, total_memory=lambda device: 2**40)
    expected, = estimate_steps(lambda: build_module(config), Target("single", 1, "32-true", 1.0), [Setting(3, "loop", None, 2, 16)])
    # the check traces the fast path's step (layers replayed: tests/estimate/test_replay.py), the full trace within 3%
    assert isinstance(roomy, StepMemory) and abs(roomy.peak - expected.peak) <= 0.03 * expected.peak, (roomy, expected)
    err = capsys.readouterr().err
    assert err.count("elr: estimated peak memory per rank") == 1 and "warning" not in err
    assert module.model.core.checkpointing == "loop" and all(not p.is_meta for p in module.parameters())


def test_the_fit_estimate_takes_the_strategys_offload_and_the_devices_headroom() -> None:
    from elr_lightning.estimate.memory import default_headroom
    from elr_lightning.strategies import OneLoopOverrideFSDPStrategy

    strategy = OneLoopOverrideFSDPStrategy(cpu_offload=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, strategy=strategy)
    target = estimate_fit.target_of_trainer(trainer)
    assert (target.strategy, target.cpu_offload, target.accelerator) == ("fsdp", True, "cpu")
    assert default_headroom("cpu")[0] == 0.25 and default_headroom("cuda")[0] == 0.10


def test_a_run_the_estimate_cannot_cover_trains_on_with_one_line(capsys) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, precision="64-true")
    module = _real_module(_config("quickstart.yaml"))
    assert log_fit_estimate(trainer, module, SimpleNamespace(batch_size=4, seq_len=8), total_memory=lambda d: 2**30) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elr: no memory estimate for this run: trainer.precision='64-true'")


def test_config_strategies_map_to_targets() -> None:
    config = _config("30b_a3b.yaml")
    target = estimate_target.target_of_config(config, 8)
    assert (target.strategy, target.cpu_offload, target.accelerator) == ("fsdp", True, "cuda")  # one 8-GPU node
    assert estimate_target.target_of_config(config, 8, cpu_offload=False).cpu_offload is False
    assert estimate_target.target_of_config(config, 8, "ddp").strategy == "ddp"
    assert estimate_target.target_of_config(config, 8, "ddp").cpu_offload is False
    four = _config("4b.yaml")
    target = estimate_target.target_of_config(four, 16)
    assert (target.strategy, target.precision, target.gradient_clip_val, target.accumulate_grad_batches) == (
        "fsdp", "bf16-mixed", 1.0, 2
    )
    assert estimate_target.target_of_config(_config("gpt_0.5b.yaml"), 8).strategy == "ddp"  # OneLoopOverrideDDPStrategy
    assert estimate_target.target_of_config(_config("quickstart.yaml"), 1).strategy == "single"
    assert estimate_target.layout_of_config(four, 8, 2) == (8, 2)


def test_gdp_layers_take_the_path_a_run_takes(monkeypatch) -> None:
    """fla's kernels only where ``elr fit`` would run them: CUDA, half precision, fla importable."""
    from elr_lightning.estimate import memory as estimate

    assert estimate.gdp_path("32-true", "cuda") == (False, "the PyTorch chunked path (32-true: fla's kernels need bf16 or fp16)")
    assert estimate.gdp_path("bf16-mixed", "cpu")[0] is False
    monkeypatch.setattr(estimate, "_fla_kernel", lambda: None)
    assert estimate.gdp_path("bf16-mixed", "cuda") == (False, "the PyTorch chunked path (fla does not import here)")
    monkeypatch.setattr(estimate, "_fla_kernel", lambda: print)
    assert estimate.gdp_path("bf16-mixed", "cuda")[0] is True
    four = _config("4b.yaml")  # bf16-mixed; with accelerator auto and kernels auto this machine's device decides
    four["trainer"]["accelerator"] = "auto"
    four["model"]["init_args"]["arch"]["mixers"]["gdp"]["init_args"]["kernels"] = "auto"
    fla, why = estimate_target.gdp_choice(four)
    assert fla is torch.cuda.is_available() and ("--gdp_kernels fla estimates a CUDA run" in why) is not fla
    assert estimate_target.gdp_choice(four, "fla") == (True, "fla's kernels (--gdp_kernels fla)")
    assert estimate_target.target_of_config(four, 8, gdp_kernels="torch").fla_kernels is False
    # the layers' own choice: torch is the chunked path anywhere; fla on a CUDA device that is not this machine's
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(estimate, "_fla_kernel", lambda: None)
    assert estimate_target.gdp_choice(_config("30b_a3b.yaml"))[0] is True  # kernels: fla, accelerator: gpu
    assert estimate_target.gdp_choice(_config("30b_a3b.yaml"), accelerator="cpu")[0] is False
    gdp = four["model"]["init_args"]["arch"]["mixers"]["gdp"]
    gdp["init_args"]["kernels"] = "torch"
    fla, why = estimate_target.gdp_choice(four, accelerator="gpu")
    assert not fla and "kernels: torch" in why


def test_the_report_says_what_it_assumed_and_what_it_does_not_model(tmp_path: Path) -> None:
    extra = tmp_path / "extra.yaml"
    extra.write_text(
        "trainer: {accumulate_grad_batches: 3}\nmodel:\n  init_args:\n    virtual_ranks: 1\n    compile_model: true\n"
    )
    paths = [str(ROOT / "config" / "quickstart_hybrid.yaml"), str(extra)]
    report = memory_report(paths, micro_batch=1, seq_len=8, loops=[1], modes=["layer"], search=False)
    assert report["target"]["accumulate_grad_batches"] == 3 and report["headroom"] == 0.25
    text = estimate_report.format_memory_report(report)
    assert "less 25% headroom (the default for CPU RAM: what glibc keeps of freed memory" in text
    assert "GDP layers: the PyTorch chunked path (32-true: fla's kernels need bf16 or fp16)" in text
    assert "not modelled: compile_model" in text and "3 micro-batches per step (gradients kept across them)" in text


def test_fsdp_layer_units_gather_one_recurrent_layer_at_a_time() -> None:
    """The recurrent block as one unit keeps all its layers gathered (and their gradients unsharded) at the peak."""
    config = _small("quickstart_hybrid.yaml")  # two recurrent layers
    setting = Setting(3, "layer", None, 1, 16)
    build = lambda: build_module(config)  # noqa: E731
    core, = estimate_steps(build, Target("fsdp", 4, recurrent_units="core"), [setting])
    layer, = estimate_steps(build, Target("fsdp", 4, recurrent_units="layer"), [setting])
    assert layer.params < core.params and layer.peak < core.peak
    assert estimate_target.target_of_config(_config("30b_a3b.yaml"), 8).recurrent_units == "layer"

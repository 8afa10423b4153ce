"""What the shipped-config tests share: the configs, their headers' ``elr estimate`` lines, and the fit check."""

from __future__ import annotations

import shlex
from pathlib import Path

from elr_lightning.estimate.command import estimate_parser
from elr_lightning.estimate.report import memory_report
from elr_lightning.lightning_cli import merged_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(path.name for path in (ROOT / "config").glob("*.yaml"))
#: The GPU configs: their steps take tens of seconds of CPU each to trace; ``test_shipped_gpu_configs.py`` checks
#: them (a file of its own, so that CI's two workers run it beside this one).
LARGE = {"gpt_0.5b.yaml", "4b.yaml", "30b_a3b.yaml"}


def header_estimate(name: str) -> list[str]:
    """The arguments of the ``elr estimate`` line in a config's header comments."""
    for line in (ROOT / "config" / name).read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.lstrip("#").split()[:2] == ["elr", "estimate"]:
            return shlex.split(line.lstrip("#"), comments=True)[2:]
    raise AssertionError(f"config/{name}: its header shows no `elr estimate --config config/{name} ...` line")


def check_fits_as_shipped(name: str) -> None:
    """The header's estimate, with rows of the config's own checkpointing only: what "fits at every k as shipped"
    needs (the other modes' rows cost as much again and prove nothing about the config)."""
    args = estimate_parser().parse_args(header_estimate(name))
    init = (merged_config(args.config)["model"].get("init_args") or {})
    own = init.get("activation_checkpointing") or "none"
    report = memory_report(
        args.config, devices=args.devices, num_nodes=args.num_nodes, device_memory=args.device_memory,
        seq_len=args.seq_len, accelerator=args.accelerator, cpu_offload=args.cpu_offload, host_memory=args.host_memory,
        search=False, modes=[own],
    )  # fmt: skip
    assert report["verdict"].startswith("fits:"), report["verdict"]
    configured = report["configured"]
    for entry in report["per_k"]:
        assert (entry["mode"], entry["micro_batch"]) == (configured["mode"], configured["micro_batch"]), (
            f"config/{name}: at k = {entry['loops']} its own {configured['mode']} at micro-batch "
            f"{configured['micro_batch']} does not fit: {report['per_k_verdict']}"
        )
    assert "over" not in report["per_k_verdict"], report["per_k_verdict"]

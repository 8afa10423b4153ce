"""Every shipped YAML parses; the paper-scale configs have the sizes the docs state (docs/cost.md)."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import pytest
import torch
import yaml

from elr_lightning.cli import run
from elr_lightning.estimate.cost import cost_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "config", "*.yaml")))
FRAGMENTS = sorted(glob.glob(os.path.join(ROOT, "callbacks", "*.yaml")))


def _print_config(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"quickstart.yaml", "gpt_0.5b.yaml", "4b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_parses(path, capsys):
    config = _print_config(["--config", path], capsys)
    assert config["model"]["class_path"].endswith("ELRModule")
    assert isinstance(config["seed_everything"], int)


@pytest.mark.parametrize("fragment", FRAGMENTS, ids=os.path.basename)
def test_callback_fragment_parses_on_top_of_quickstart(fragment, capsys):
    quickstart = os.path.join(ROOT, "config", "quickstart.yaml")
    config = _print_config(["--config", quickstart, "--config", fragment], capsys)
    assert config["trainer"]["callbacks"]


@pytest.mark.parametrize("name, low, high", [("gpt_0.5b.yaml", 0.45e9, 0.60e9), ("4b.yaml", 3.8e9, 4.3e9)])
def test_paper_scale_parameter_counts(name, low, high):
    report = cost_report(os.path.join(ROOT, "config", name))
    assert low <= report["parameters"]["total"] <= high


def test_gpt_0p5b_is_the_paper_ablation_sampler():
    report = cost_report(os.path.join(ROOT, "config", "gpt_0.5b.yaml"))
    assert report["expected_p1"] == pytest.approx(0.32)


def test_missing_user_data_is_a_clear_error():
    with pytest.raises((FileNotFoundError, ValueError), match=r"data\.sources"):
        run(["fit", "--config", os.path.join(ROOT, "config", "4b.yaml"), "--trainer.max_steps", "1"])


def test_cost_report_reproduces_the_paper_figures_for_4b(capsys):
    report = cost_report(os.path.join(ROOT, "config", "4b.yaml"))
    kv = report["kv_bytes_per_token_bf16"]
    assert kv[4]["per_loop"] / kv[1]["per_loop"] == pytest.approx(2.5)  # paper §5.3: 2.5x at k = 4
    assert kv[4]["last_loop"] == kv[1]["last_loop"] == kv[1]["per_loop"]
    assert round(report["eq5_multiplier"][0.25], 2) == 1.16  # paper §3.4
    flops = report["forward_gflops_per_token"]
    assert flops[1] < flops[2] < flops[3] < flops[4]
    run(["cost", "--config", os.path.join(ROOT, "config", "4b.yaml"), "--json"])
    assert '"eq5_multiplier"' in capsys.readouterr().out


def test_documented_strategy_command_line_parses(capsys):
    """The way the README and the docs pick a strategy on the command line."""
    pages = [Path(ROOT) / "README.md", *sorted((Path(ROOT) / "docs").rglob("*.md"))]
    docs = "".join(page.read_text() for page in pages)
    flags = re.findall(r"--trainer\.strategy\S*", docs)
    assert flags and all(f.startswith("--trainer.strategy.") for f in flags), flags
    config = _print_config(
        ["--config", os.path.join(ROOT, "config", "4b.yaml"),
         "--trainer.strategy.class_path", "elr_lightning.strategies.OneLoopOverrideFSDPStrategy",
         "--trainer.strategy.timeout", "0:30:00"],
        capsys,
    )
    assert config["trainer"]["strategy"]["class_path"] == "elr_lightning.strategies.OneLoopOverrideFSDPStrategy"


def test_cost_merges_every_config_as_fit_does_and_uses_its_switch_fraction(tmp_path, capsys):
    wider = tmp_path / "wider.yaml"
    wider.write_text("model:\n  init_args:\n    arch:\n      d_model: 256\n      n_heads: 8\n")
    switch = tmp_path / "switch.yaml"
    switch.write_text(
        "trainer:\n  callbacks+:\n    - class_path: elr_lightning.callbacks.DelayedMixedDepth\n"
        "      init_args: {switch_fraction: 0.6}\n"
    )
    quickstart = os.path.join(ROOT, "config", "quickstart.yaml")
    alone = cost_report(quickstart)
    merged = cost_report([quickstart, str(wider), str(switch)])
    assert alone["mixed_fraction"] == 1.0  # no delayed switch: mixed from scratch
    assert merged["mixed_fraction"] == pytest.approx(0.4)
    assert merged["parameters"]["total"] > 3 * alone["parameters"]["total"]  # d_model 128 -> 256
    assert merged["eq5_multiplier"][merged["mixed_fraction"]] < merged["eq5_multiplier"][1.0]
    fragment = os.path.join(ROOT, "callbacks", "delayed_mixed_depth.yaml")
    run(["cost", "--config", quickstart, "--config", fragment])
    assert "this config mixes the last 25% of tokens" in capsys.readouterr().out


def test_the_documented_lever_snippet_builds_a_module(tmp_path: Path) -> None:
    """The ablations guide's YAML of the lab note's levers merges onto the quickstart and instantiates."""
    from elr_lightning.lightning_cli import ConfigOnlyCLI, make_cli
    from elr_lightning.module import ELRModule
    from elr_lightning.sampling import LoopCurriculum

    page = (Path(ROOT) / "docs" / "ablations.md").read_text()
    start = page.index("The levers the lab note tried")
    snippet = page[page.index("```yaml\n", start) + 8 : page.index("```", page.index("```yaml\n", start) + 8)]
    (tmp_path / "levers.yaml").write_text(snippet)
    cli = make_cli(
        ConfigOnlyCLI,
        ["--config", str(Path(ROOT) / "config" / "quickstart.yaml"), "--config", str(tmp_path / "levers.yaml")],
        run=False,
    )
    init = cli.parser.instantiate_classes(cli.config)
    module = init["model"]
    assert isinstance(module, ELRModule) and isinstance(module.sampler, LoopCurriculum)
    assert module.hparams.lr_scale == {"gate": 10}
    beta = module.model.update.beta(torch.zeros(1, 2, module.model.config.d_model))
    assert torch.allclose(beta, torch.full_like(beta, 0.7))

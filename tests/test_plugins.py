"""A user's own state-update rule, in their own package, named by class_path in YAML (docs/extending.md)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import torch

from elr_lightning.cli import run

ROOT = Path(__file__).resolve().parents[1]


def _documented_rule() -> str:
    """The ``my_lab/rules.py`` code block of the extending guide, verbatim."""
    page = (ROOT / "docs" / "extending.md").read_text()
    block = re.search(r"```python\n# my_lab/rules.py\n(.*?)```", page, re.S)
    assert block, "docs/extending.md lost its plug-in example"
    return block.group(1)


def test_documented_plugin_trains_from_yaml(tmp_path, monkeypatch):
    package = tmp_path / "my_lab"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rules.py").write_text(_documented_rule())
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""\
        seed_everything: 0
        trainer:
          accelerator: cpu
          max_steps: 3
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          num_sanity_val_steps: 0
          limit_val_batches: 1
          default_root_dir: {tmp_path}
        model:
          class_path: elr_lightning.ELRModule
          init_args:
            arch: {{d_model: 32, n_heads: 2, n_in: 1, n_rec: 1, n_out: 1, max_seq_len: 32, max_loops: 2}}
            update: {{class_path: my_lab.rules.ScalarGate}}
            virtual_ranks: 2
            warmup_steps: 1
        data:
          class_path: elr_lightning.data.TextDataModule
          init_args: {{seq_len: 16, batch_size: 4, max_bytes: 20000, cache_dir: {tmp_path / "cache"}}}
        """))
    trained = {}

    from my_lab.rules import ScalarGate

    original = ScalarGate.forward

    def spy(self, s_prev, r, s_tilde):
        trained["a"] = self.a.detach().clone()
        return original(self, s_prev, r, s_tilde)

    monkeypatch.setattr(ScalarGate, "forward", spy)
    run(["fit", "--config", str(config)])
    assert "a" in trained and trained["a"].shape == torch.Size([])
    assert trained["a"].item() != 0.0  # the optimizer moved the user's parameter

"""A checkpoint written before the package regroup (issue 46) loads unchanged and computes the same logits.

``fixtures/pre_regroup.ckpt`` was written by ``Trainer.save_checkpoint`` with the flat package (an
``AdaptiveDelta`` update, a ``OneLoopOverride`` sampler, a ``LoopConditioner`` and a byte tokenizer);
``pre_regroup.json`` holds the last-position logits that code computed for a prompt at every k.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FIXTURES
from elr_lightning.conditioning import LoopConditioner
from elr_lightning.inference.generate import load_model
from elr_lightning.sampling import OneLoopOverride
from elr_lightning.tokenizers import ByteTokenizer
from elr_lightning.updates import AdaptiveDelta

@pytest.fixture(scope="module")
def loaded():
    return load_model(str(FIXTURES / "pre_regroup.ckpt"))


def test_the_plugins_and_tokenizer_it_names_are_rebuilt(loaded) -> None:
    _, module = loaded
    assert isinstance(module.model.core.update, AdaptiveDelta)
    assert isinstance(module.sampler, OneLoopOverride)
    assert isinstance(module.model.core.conditioner, LoopConditioner)
    assert isinstance(module.tokenizer, ByteTokenizer)


@pytest.mark.parametrize("loops", [1, 2, 3])
def test_it_computes_the_logits_the_code_that_wrote_it_computed(loaded, loops: int) -> None:
    model, _ = loaded
    expected = json.loads((FIXTURES / "pre_regroup.json").read_text())
    ids = torch.tensor([list(expected["prompt"].encode())])
    with torch.no_grad():
        got = model(ids, loops=loops)[0, -1]
    torch.testing.assert_close(got, torch.tensor(expected["last_logits"][str(loops)]), atol=1e-4, rtol=0)

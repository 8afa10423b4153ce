"""The token-level depth suite: labels against independent solvers, the held-out split, the step-indexed data,
the character tokenizer, and the scorer."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import REPO_ROOT, tiny_config
from elr_lightning.inference.decode import AdaptiveDepth
from elr_lightning.depth import TASKS, DepthDataModule, get_task, is_heldout
from elr_lightning.depth.datamodule import DepthSteps, instances
from elr_lightning.depth.score import decode_teacher_forced, score, score_adaptive
from elr_lightning.batches import IGNORE_INDEX
from elr_lightning.model import LoopedLM
from elr_lightning.checkpoints.tokenizer import tokenizer_from_state, tokenizer_state
from elr_lightning.tokenizers import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = str(REPO_ROOT)


def _solve(task: str, text: str) -> list[str | None]:
    """An independent solver: the label character at every position of ``text`` (``None``: unlabelled)."""
    if task == "parity":
        assert text[0] == "^" and "^" not in text[1:]
        return [None] + [str(text[1 : t + 1].count("1") % 2) for t in range(1, len(text))]
    if task == "root":
        root_of: list[str] = []
        for t, ch in enumerate(text):
            root_of.append(ch if ch.isalpha() else root_of[t - int(ch)])
        return [None if ch.isalpha() else root_of[t] for t, ch in enumerate(text)]
    if task == "addition":
        out: list[str | None] = []
        total = 0
        for operand in text.split("+"):
            total = (total + int(operand[::-1])) % 100  # least significant digit first
            out += [f"{total:02d}"[::-1][i] for i in range(len(operand))] + [None]
        return out[:-1]
    raise AssertionError(task)


@given(task=st.sampled_from(sorted(TASKS)), seed=st.integers(0, 2**32 - 1), step=st.integers(0, 3))
def test_labels_match_an_independent_solver(task, seed, step):
    t = TASKS[task]
    difficulty = t.min_difficulty + step
    ids, labels, levels = t.draw(np.random.default_rng(seed), 3, difficulty)
    assert ids.shape == labels.shape == levels.shape == (3, t.length(difficulty))
    for row in range(3):
        text = "".join(t.alphabet[i] for i in ids[row])
        expected = _solve(task, text)
        got = [t.alphabet[i] if i != IGNORE_INDEX else None for i in labels[row]]
        assert got == expected, text
        labelled = labels[row] != IGNORE_INDEX
        assert (levels[row][labelled] >= 1).all() and (levels[row][~labelled] == 0).all()
        assert levels[row].max() == difficulty  # every instance holds a label of its own difficulty


@given(seed=st.integers(0, 2**32 - 1), difficulty=st.integers(1, 8))
def test_root_levels_are_depths_and_pointers_stay_short(seed, difficulty):
    t = TASKS["root"]
    ids, labels, levels = t.draw(np.random.default_rng(seed), 2, difficulty)
    for row in range(2):
        text = "".join(t.alphabet[i] for i in ids[row])
        for pos in np.flatnonzero(labels[row] != IGNORE_INDEX):
            node, depth = pos, 0
            while not text[node].isalpha():
                node, depth = node - int(text[node]), depth + 1
            assert levels[row, pos] == depth


@given(task=st.sampled_from(sorted(TASKS)), seed=st.integers(0, 1000))
def test_training_and_heldout_instances_never_share_a_key(task, seed):
    t = TASKS[task]
    train = instances(t, t.min_difficulty + 2, range(16), seed, "train", 0)["input_ids"].numpy()
    val = instances(t, t.min_difficulty + 2, range(16), seed, "val", 0)["input_ids"].numpy()
    assert not any(is_heldout(t, row) for row in train)
    assert all(is_heldout(t, row) for row in val)
    keys = {tuple(row[: t.key_length]) for row in train}
    assert keys.isdisjoint(tuple(row[: t.key_length]) for row in val)


def test_steps_are_fresh_deterministic_and_split_by_rank():
    t = get_task("parity")
    one = DepthSteps(t, lambda s: 12, batch_size=8, seed=3)
    again = DepthSteps(t, lambda s: 12, batch_size=8, seed=3)
    assert torch.equal(one.batch_at(0, 5)["input_ids"], again.batch_at(0, 5)["input_ids"])
    assert not torch.equal(one.batch_at(0, 5)["input_ids"], one.batch_at(0, 6)["input_ids"])
    ranks = [DepthSteps(t, lambda s: 12, batch_size=4, seed=3, rank=r, world_size=2).batch_at(0, 5) for r in (0, 1)]
    for key in ("input_ids", "labels"):
        assert torch.equal(torch.cat([b[key] for b in ranks]), one.batch_at(0, 5)[key])
    step_two = one.batch_at(1, 2)  # epoch 1, position 2 is global step 1002
    assert torch.equal(step_two["input_ids"], instances(t, 12, range(8), 3, "train", 1002)["input_ids"])


def test_loader_resumes_where_it_stopped():
    data = DepthDataModule("addition", 4, batch_size=4, seed=1)
    loader = data.train_dataloader()
    it = iter(loader)
    seen = [next(it) for _ in range(3)]
    state = loader.state_dict()
    fresh = DepthDataModule("addition", 4, batch_size=4, seed=1).train_dataloader()
    fresh.load_state_dict(state)
    resumed = next(iter(fresh))
    assert torch.equal(resumed["labels"], next(it)["labels"])
    assert not torch.equal(resumed["labels"], seen[-1]["labels"])
    other = DepthDataModule("addition", 4, batch_size=4, seed=2).train_dataloader()
    with pytest.raises(ValueError, match="data.seed"):
        other.load_state_dict(state)


def test_curriculum_raises_the_difficulty_to_its_maximum():
    data = DepthDataModule("root", 6, curriculum_steps=100, batch_size=2)
    assert [data.difficulty_at(s) for s in (0, 50, 99, 100, 10_000)] == [1, 3, 5, 6, 6]
    assert data.train_dataloader().batch_at(0, 0)["input_ids"].shape[1] == TASKS["root"].length(1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"task": "sorting"}, "data.task"),
        ({"task": "parity", "difficulty": 4}, "data.difficulty"),
        ({"task": "root", "difficulty": 25}, "data.difficulty"),
        ({"batch_size": 0}, "data.batch_size"),
        ({"curriculum_steps": -1}, "data.curriculum_steps"),
        ({"task": "root", "difficulty": 4, "eval_difficulties": [0]}, "data.eval_difficulties"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        DepthDataModule(**kwargs)


def test_data_module_serves_labelled_batches_and_the_task_alphabet():
    data = DepthDataModule("root", 4, batch_size=3, val_batches=2)
    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].dtype == torch.long
    assert data.tokenizer.alphabet == TASKS["root"].alphabet and data.vocab_size == 13
    assert data.seq_len == TASKS["root"].length(max(data.eval_difficulties))
    val = list(data.val_dataloader())
    assert sum(len(b["input_ids"]) for b in val) == 6
    assert all(is_heldout(data.task, row.numpy()) for b in val for row in b["input_ids"])


@given(text=st.text(alphabet="0123456789+", max_size=20))
def test_char_tokenizer_round_trips_and_travels_as_its_alphabet(text):
    tok = CharTokenizer("0123456789+")
    assert tok.decode(tok.encode(text)) == text
    rebuilt = tokenizer_from_state(tokenizer_state(tok))
    assert isinstance(rebuilt, CharTokenizer) and rebuilt.fingerprint() == tok.fingerprint()
    assert int(tok.token_bytes().sum()) == 11


def test_char_tokenizer_refuses_text_outside_its_alphabet():
    with pytest.raises(ValueError, match=r"'x'.*alphabet '01'"):
        CharTokenizer("01").encode("01x")
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer("0110")
    assert CharTokenizer("01").decode([0, 5]) == "0\ufffd"


class Oracle(torch.nn.Module):
    """A stand-in model that predicts the label it is told about at loops >= ``needs``, a wrong token below."""

    def __init__(self, labels: torch.Tensor, needs: int) -> None:
        super().__init__()
        self.labels, self.needs = labels, needs
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def forward(self, ids: torch.Tensor, loops: int) -> torch.Tensor:
        target = self.labels.clamp_min(0) if loops >= self.needs else (self.labels.clamp_min(0) + 1) % 2
        return torch.nn.functional.one_hot(target, 2).float()


def test_score_counts_exact_matches_per_difficulty_and_k():
    from elr_lightning.depth.score import heldout_arrays

    task = TASKS["parity"]
    _, labels, _ = heldout_arrays(task, 8, 16, seed=0)
    table = score(Oracle(labels, needs=2), task, [8], [1, 2, 3], n=16, seed=0)
    assert [table[8][k]["exact"] for k in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert table[8][2]["deep"] == 1.0 and table[8][1]["deep"] == 0.0


@pytest.mark.parametrize("task, difficulty, space", [("parity", 8, 41), ("parity", 9, 82), ("root", 2, None)])
def test_heldout_draws_are_distinct_up_to_the_size_of_the_heldout_space(task, difficulty, space):
    from elr_lightning.depth.score import format_table, heldout_arrays

    t = TASKS[task]
    ids, _, _ = heldout_arrays(t, difficulty, 256, seed=0)
    rows = {tuple(row.tolist()) for row in ids}
    assert len(rows) == len(ids) == (256 if space is None else space)
    if space is not None:  # every held-out string of the space, and nothing else
        every = [np.array([2] + [int(c) for c in np.binary_repr(i, difficulty)]) for i in range(2**difficulty)]
        assert rows == {tuple(bits.tolist()) for bits in every if is_heldout(t, bits)}
    table = score(Oracle(torch.zeros(len(ids), t.length(difficulty), dtype=torch.long), needs=1), t, [difficulty], [1], n=256)
    assert table[difficulty][1]["instances"] == len(ids)
    assert f"| {difficulty} | {len(ids)} | " in format_table(table, "exact", t)


def test_decoded_fixed_k_equals_the_forward_pass_and_auto_counts_its_loops():
    torch.manual_seed(0)
    model = LoopedLM(tiny_config(vocab_size=3, max_loops=3)).eval()
    task = TASKS["parity"]
    ids = torch.randint(0, 3, (3, 10))
    logits, loops = decode_teacher_forced(model, ids, 2)
    torch.testing.assert_close(logits, model(ids, 2), atol=1e-5, rtol=1e-5)
    assert bool((loops == 2).all())
    fixed = score(model, task, [8], [3], n=8)[8][3]
    decoded = score_adaptive(model, task, [8], 3, n=8)[8]
    assert decoded["exact"] == fixed["exact"] and decoded["mean_loops"] == 3.0
    always_exits = score_adaptive(model, task, [8], AdaptiveDepth(3, float(1e9)), n=8)[8]
    assert always_exits["mean_loops"] < 1.3  # every decoded token leaves after loop 1; the first runs at 3


def test_serving_refuses_a_prompt_outside_the_alphabet_naming_the_prompt():
    pytest.importorskip("litserve")
    from elr_lightning.serve.api import CompletionsSpec, RequestError

    spec = CompletionsSpec(tiny_config(vocab_size=2), CharTokenizer("01"), "parity", loops_default=1, loops_max=4)
    with pytest.raises(RequestError) as info:
        spec.parse(b'{"prompt": "0121"}')
    assert info.value.param == "prompt" and info.value.status == 400 and "'2'" in str(info.value)
    assert spec.parse(b'{"prompt": "0110", "max_tokens": 1}')[1].prompt_ids == (0, 1, 1, 0)


def _depth_config(tmp_path) -> str:
    """The shipped quickstart, shrunk to a few steps of a tiny model on shallow forests."""
    import yaml

    with open(os.path.join(ROOT, "config", "quickstart_depth.yaml")) as f:
        config = yaml.safe_load(f)
    config["trainer"].update(max_steps=2, val_check_interval=2, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[])  # fmt: skip
    config["model"]["init_args"]["arch"].update(d_model=16, n_heads=2, max_loops=2)
    config["model"]["init_args"]["sampler"]["init_args"]["max_loops"] = 2
    config["model"]["init_args"]["warmup_steps"] = 0
    config["data"]["init_args"].update(difficulty=2, batch_size=4, val_batches=1, eval_difficulties=[1, 2])
    path = tmp_path / "depth.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
def test_ablate_scores_depth_arms_and_checks_the_targets(tmp_path):
    from elr_lightning.ablate.run import run_ablation

    results = run_ablation(_depth_config(tmp_path), str(tmp_path / "out"), arms=["baseline", "elr"], depth=4,
                           log=lambda line: None)  # fmt: skip
    depth = {run["arm"]: run["depth"] for run in results}
    assert depth["baseline"]["task"] == "root" and depth["elr"]["trained_difficulty"] == 2
    assert set(depth["baseline"]["exact"]["2"]) == {"1"}  # the non-recurrent baseline runs once
    assert set(depth["elr"]["exact"]["2"]) == {"1", "2", "3", "4"}  # 1..2K
    assert depth["elr"]["instances"] == depth["baseline"]["instances"] == {"1": 4, "2": 4}
    report = (tmp_path / "out" / "ablate.md").read_text()
    assert "## Depth task `root`" in report and "k = 1 within 2 points of the baseline" in report
    assert "Distinct held-out instances per difficulty (the same for every arm, seed and k): 1: 4, 2: 4." in report
    assert (tmp_path / "out" / "depth_heatmaps.png").stat().st_size > 0


@pytest.mark.slow
def test_quickstart_trains_then_eval_tables_and_generate_decodes_in_the_alphabet(tmp_path, capsys):
    """The shipped depth config (shrunk) through `elr fit` with its DepthAccuracy callback, `elr eval` and `elr generate`."""
    import json

    import yaml

    from elr_lightning.cli import run

    path = _depth_config(tmp_path)
    config = yaml.safe_load(open(path))
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(tmp_path / "tb"), "name": "fit"}}
    config["trainer"].update(default_root_dir=str(tmp_path / "runs"), logger=logger, callbacks=[
        {"class_path": "elr_lightning.callbacks.DepthAccuracy", "init_args": {"n": 4}},
        {"class_path": "elr_lightning.callbacks.AtomicModelCheckpoint", "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}},
    ])  # fmt: skip
    open(path, "w").write(yaml.safe_dump(config))
    run(["fit", "--config", path])
    ckpt = str(tmp_path / "ckpt" / "last.ckpt")
    capsys.readouterr()
    run(["eval", "--ckpt_path", ckpt, "--limit", "4", "--loops", "1,2,4,auto", "--threshold", "0.1,0.01", "--allow_extrapolation",
         "--output_dir", str(tmp_path / "eval"), "--log_dir", str(tmp_path / "tb" / "eval")])  # fmt: skip
    table = capsys.readouterr().out
    assert "exact match (%) of up to 4 distinct held-out instances per difficulty" in table
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["task"] == "root" and summary["difficulties"] == [1, 2] and summary["loops"] == [1, 2, 4]
    assert set(summary["exact"]["1"]) == {"1", "2", "4"} and set(summary["adaptive"]) == {"auto:kl:0.1", "auto:kl:0.01"}
    assert summary["instances"]["2"] == {"1": 4, "2": 4, "4": 4}
    assert all(0.0 <= v <= 100.0 for row in summary["exact"].values() for v in row.values())
    assert (tmp_path / "eval" / "depth_heatmap.png").stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for folder, prefix in ((tmp_path / "tb" / "fit" / "version_0", "val_depth"), (tmp_path / "tb" / "eval", "eval_depth")):
        events = EventAccumulator(str(folder), size_guidance={"images": 0, "tensors": 0})
        events.Reload()
        assert f"{prefix}/heatmap" in events.Tags()["images"]
        text = events.Tensors(f"{prefix}/table/text_summary")[-1].tensor_proto.string_val[0].decode()
        assert text.startswith("| root | instances | k=1 | k=2 |") and "| 2 | 4 |" in text
    run(["generate", "--ckpt_path", ckpt, "--loops", "2", "--max_new_tokens", "3", "--temperature", "0",
         "--prompt", "A1B12"])  # fmt: skip
    text = capsys.readouterr().out.strip()
    alphabet = get_task("root").alphabet
    assert text.startswith("A1B12") and len(text) == 8 and set(text) <= set(alphabet)


def test_depth_targets_flag_dips_beyond_the_budget_and_the_longer_forests():
    from elr_lightning.depth.report import checks

    flat = {d: {k: [1.0, 1.0] for k in range(1, 5)} for d in (1, 2)}
    elr = {**flat, 4: {k: [0.5 + 0.2 * (k == 3), 0.9] for k in range(1, 5)}}
    table = {"elr": {d: {k: list(v) for k, v in row.items()} for d, row in elr.items()}}
    table["elr"][2][1] = [0.0, 0.0]
    status = {claim.split(":")[0]: (figure, verdict) for claim, figure, verdict in checks(table, 2, 2)}
    assert status["trained difficulties"] == ("worst: difficulty 1, k = 3, 100.0 vs 100.0", "holds")
    assert status["difficulty 4 (twice the trained)"] == ("best: k = 3, 80.0", "holds")
    table["elr"][2][4] = [0.99, 0.96]  # 2.5 points below k = K at a trained difficulty
    table["elr"][4][3] = [0.5, 0.9]
    status = {claim.split(":")[0]: (figure, verdict) for claim, figure, verdict in checks(table, 2, 2)}
    assert status["trained difficulties"] == ("worst: difficulty 2, k = 4, 97.5 vs 100.0", "does not hold")
    assert status["difficulty 4 (twice the trained)"] == ("best: k = 1, 70.0", "does not hold")

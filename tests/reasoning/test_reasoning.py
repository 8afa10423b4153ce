"""Synthetic reasoning tasks: answers, determinism, the train / held-out split, refusals, the mix and scoring."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typing_extensions import override

from elr_lightning.config import ModelConfig
from elr_lightning.model import LoopedLM
from elr_lightning.reasoning import (
    GENERATORS,
    ReasoningTextDataModule,
    accuracy,
    answer_loss,
    get_generator,
    heldout_instances,
    is_heldout,
    parse_levels,
    pack_windows,
    reasoning_documents,
    score_levels,
    training_instances,
)
from elr_lightning.reasoning.generators import Instance
from elr_lightning.tokenizers import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

LEVELS = [(name, level) for name, g in GENERATORS.items() for level in g.difficulties()]


def _solve(instance: Instance) -> str:
    """An independent solver of each task's prompt, to check the generators' answers."""
    prompt = instance.prompt
    if instance.task == "addition":
        a, b = prompt.rstrip("=").split("+")
        return str(int(a) + int(b))
    if instance.task == "variables":
        *program, query = prompt.split(";")
        env: dict[str, str] = {}
        for statement in program:
            name, value = statement.split("=")
            env[name] = env[value] if value in env else value
        return env[query.rstrip("?")]
    table, query = prompt.rsplit(" ", 1)
    step = dict(pair.split(">") for pair in table.split(" "))
    letter, hops = query.rstrip("=").split("@")
    for _ in range(int(hops)):
        letter = step[letter]
    return letter


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(LEVELS), st.integers(0, 2**31 - 1))
def test_answers_are_right_and_difficulty_is_the_knob(level, seed):
    task, difficulty = level
    for instance in training_instances(task, difficulty, 5, seed):
        assert _solve(instance) == instance.answer and "\n" not in instance.answer
        assert instance.text == instance.prompt + instance.answer + "\n"
        if task == "addition":
            assert all(len(x) == difficulty for x in instance.prompt.rstrip("=").split("+"))
        elif task == "hops":
            assert instance.prompt.endswith(f"@{difficulty}=") and len(set(re.findall(r"[a-z]", instance.prompt))) == 8
        else:
            assert instance.prompt.count(";") == 3 * (difficulty + 1)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(LEVELS), st.integers(0, 1000))
def test_training_and_heldout_never_overlap_and_are_deterministic(level, seed):
    task, difficulty = level
    train = training_instances(task, difficulty, 200, seed)
    held = heldout_instances(task, difficulty, 50, seed)
    assert {i.prompt for i in train}.isdisjoint(i.prompt for i in held)
    assert all(is_heldout(task, i.prompt) for i in held) and not any(is_heldout(task, i.prompt) for i in train)
    assert training_instances(task, difficulty, 200, seed) == train
    assert heldout_instances(task, difficulty, 50, seed) == held
    assert len({i.prompt for i in held}) == len(held)


def test_seeds_draw_different_instances_and_small_levels_stop_short():
    assert training_instances("hops", 3, 20, 0) != training_instances("hops", 3, 20, 1)
    one_digit = heldout_instances("addition", 1, 100)
    assert 0 < len(one_digit) < 100  # only about 1/8 of the 100 one-digit sums is held out
    assert len(heldout_instances("variables", 2, 100)) == 100


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: training_instances("hops", 0, 1), r"difficulty 0 of reasoning task 'hops' is out of range; choose 1\.\.6"),
        (lambda: heldout_instances("addition", 9, 1), r"difficulty 9 .* choose 1\.\.8"),
        (lambda: training_instances("hops", 2.0, 1), r"difficulty 2\.0 .* out of range"),
        (lambda: get_generator("parity"), r"unknown reasoning task 'parity'; choose one of addition, variables, hops"),
        (lambda: training_instances("hops", 1, 1, seed="0"), r"seed='0' is not an integer"),
        (lambda: heldout_instances("hops", 1, 1, seed=1.5), r"seed=1\.5 is not an integer"),
        (lambda: training_instances("hops", 1, 1, seed=True), r"seed=True is not an integer"),
        (lambda: parse_levels("2-9", "variables"), r"difficulty 7 .* choose 1\.\.6"),
        (lambda: parse_levels([], "hops"), r"empty list"),
    ],
)
def test_bad_input_is_refused_in_one_line(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


def test_levels_parse_from_config_forms():
    assert parse_levels(None, "hops") == [1, 2, 3, 4, 5, 6]
    assert parse_levels("2-4", "hops") == [2, 3, 4]
    assert parse_levels(3, "hops") == [3]
    assert parse_levels([4, 1, 4], "addition") == [1, 4]


def test_documents_mix_every_level_and_pack_instances():
    docs = reasoning_documents({"hops": "1-2", "addition": [3]}, 40, seed=0, per_document=16)
    lines = "".join(docs).splitlines()
    assert len(lines) == 120 and len(docs) == 8
    assert {line.split("@")[1][0] for line in lines if "@" in line} == {"1", "2"}
    assert sum("+" in line for line in lines) == 40
    assert reasoning_documents({"hops": "1-2", "addition": [3]}, 40, seed=0, per_document=16) == docs


def _text(tmp_path) -> str:
    path = tmp_path / "text.txt"
    path.write_text("".join(f"line {i} of plain text\n" for i in range(400)))
    return str(path)


def test_datamodule_puts_synthetic_documents_first_and_keeps_the_text_for_validation(tmp_path):
    kwargs = dict(sources=[_text(tmp_path)], seq_len=48, batch_size=4, cache_dir=str(tmp_path / "cache"), val_fraction=0.05)
    data = ReasoningTextDataModule(reasoning_tasks={"hops": 1}, examples_per_level=100, **kwargs)
    data.prepare_data()
    data.setup("fit")
    with open(data.reasoning_path) as f:
        records = [json.loads(line)["text"] for line in f]
    assert len("".join(records).split()) == 100 * 9 and os.stat(data.reasoning_path).st_mtime_ns == 0
    stream = bytes(data.tokens.tolist()).decode()
    assert stream.startswith(records[0]) and "line 399 of plain text" in stream
    val = bytes(data.val_windows[len(data.val_windows) - 1].tolist()).decode()
    assert "of plain text" in val and "@" not in val
    again = ReasoningTextDataModule(reasoning_tasks={"hops": 1}, examples_per_level=100, **kwargs)
    assert again.cache_paths() == data.cache_paths()  # same file signature: the token cache is reused
    other = ReasoningTextDataModule(reasoning_tasks={"hops": 1}, examples_per_level=100, seed=1, **kwargs)
    assert other.reasoning_path != data.reasoning_path
    unpacked = ReasoningTextDataModule(reasoning_tasks={"hops": 1}, examples_per_level=100, pack=False, **kwargs)
    assert unpacked.reasoning_path != data.reasoning_path
    assert unpacked.documents == reasoning_documents({"hops": [1]}, 100, seed=0)


_INSTANCE = re.compile(r"^(\d+\+\d+=\d+|([a-z]>[a-z] ){8}[a-z]@\d=[a-z])$")


@settings(max_examples=8, deadline=None)
@given(seq_len=st.integers(48, 160), seed=st.integers(0, 3))
def test_packed_windows_start_at_an_instance_and_cut_none(tmp_path_factory, seq_len, seed):
    tmp_path = tmp_path_factory.mktemp("pack")
    data = ReasoningTextDataModule(
        reasoning_tasks={"hops": "1-2", "addition": "1-4"}, examples_per_level=30, seed=seed, sources=[_text(tmp_path)],
        seq_len=seq_len, batch_size=2, cache_dir=str(tmp_path / "cache"), val_fraction=0.05,
    )
    data.setup("fit")
    lines = []
    for i in range(len(data.documents)):  # the synthetic windows, each one document and its separator
        window = bytes(data.train_windows[i].tolist()).decode()
        assert window[: seq_len - 1] == data.documents[i] and window[seq_len - 1] == "\n"
        lines.extend(line for line in window[: seq_len - 1].split("\n") if line)
    assert len(lines) == 180 and all(_INSTANCE.match(line) for line in lines)


def test_packing_refuses_an_instance_longer_than_a_window_and_warns_when_filler_merges():
    with pytest.raises(ValueError, match=r"^data\.seq_len: a reasoning instance of 9 tokens does not fit a window of 8"):
        pack_windows(["12+345=357\n"[:9]], 8, len)
    merged = lambda text: len(text.replace("\n\n", "\n"))  # noqa: E731 - a tokenizer with a token for two newlines
    with pytest.warns(UserWarning, match=r"data\.pack: .* 1 of 1 reasoning documents are not exactly one window"):
        docs = pack_windows(["1+2=3\n"], 12, merged)
    assert docs[0].startswith("1+2=3\n") and merged(docs[0]) <= 12
    assert pack_windows(["1+2=3\n", "4+5=9\n", "9+9=18\n"], 13, len) == ["1+2=3\n4+5=9\n\n", "9+9=18\n" + "\n" * 6]


def test_text_bytes_caps_the_text_after_the_synthetic_documents(tmp_path):
    kwargs = dict(sources=[_text(tmp_path)], seq_len=16, batch_size=2, cache_dir=str(tmp_path / "cache"))
    data = ReasoningTextDataModule(reasoning_tasks={"addition": 1}, examples_per_level=50, text_bytes=100, **kwargs)
    data.setup("fit")
    stream = bytes(data.tokens.tolist()).decode()
    assert stream.count("+") == 50 and stream.endswith("\nline 4 of plain ")
    with pytest.raises(ValueError, match=r"data\.text_bytes=100 .* set only one"):
        ReasoningTextDataModule(text_bytes=100, max_bytes=1000, **kwargs)
    with pytest.raises(ValueError, match=r"data\.seed='x' is not an integer"):
        ReasoningTextDataModule(seed="x", **kwargs)
    with pytest.raises(ValueError, match=r"^data\.reasoning_tasks: unknown reasoning task 'sorting'; choose one of"):
        ReasoningTextDataModule(reasoning_tasks={"sorting": None}, **kwargs)
    with pytest.raises(ValueError, match=r"^data\.reasoning_tasks: difficulty 9 of reasoning task 'hops' is out of range"):
        ReasoningTextDataModule(reasoning_tasks={"hops": [1, 9]}, **kwargs)


class _Oracle(LoopedLM):
    """A model that spells the right answer of known prompts from k = 2 on, and a wrong digit at k = 1."""

    def __init__(self, answers: dict[str, str]) -> None:
        super().__init__(ModelConfig(vocab_size=256, d_model=8, n_heads=2, n_in=1, n_rec=1, n_out=1, max_seq_len=64))
        self.answers = answers

    @override
    def forward(self, input_ids, loops=1, **_):  # type: ignore[override]
        logits = torch.zeros(*input_ids.shape, 256)
        for row, ids in enumerate(input_ids.tolist()):
            text = bytes(ids).decode()
            prompt = next(p for p in self.answers if text.startswith(p))
            written = text[len(prompt) :]
            full = (self.answers[prompt] if loops > 1 else "?") + "\n"
            logits[row, -1, ord(full[len(written)] if len(written) < len(full) else "\n")] = 1.0
        return logits


def test_scoring_is_exact_match_per_level_and_k():
    held = heldout_instances("addition", 2, 10) + heldout_instances("hops", 3, 10)
    model = _Oracle({i.prompt: i.answer for i in held})
    assert accuracy(model, ByteTokenizer(), held, loops=2, batch_size=3) == 1.0
    assert accuracy(model, ByteTokenizer(), held, loops=1) == 0.0
    table = score_levels(model, ByteTokenizer(), {"addition": 2, "hops": [3]}, loops=[1, 2], n=10)
    assert table == {"addition": {2: {1: 0.0, 2: 1.0}}, "hops": {3: {1: 0.0, 2: 1.0}}}


def test_scoring_a_real_model_matches_its_greedy_decoding():
    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(vocab_size=256, d_model=16, n_heads=2, n_in=1, n_rec=1, n_out=1, max_seq_len=64)).eval()
    held = heldout_instances("hops", 1, 6)
    from elr_lightning.reasoning.score import greedy_answers

    answers = greedy_answers(model, ByteTokenizer(), [i.prompt for i in held], loops=2, max_new_tokens=3, batch_size=2)
    for instance, answer in zip(held, answers):
        ids = torch.tensor([list(instance.prompt.encode())])
        for _ in range(3):
            ids = torch.cat([ids, model(ids, loops=2)[:, -1:].argmax(-1)], dim=1)
        assert answer == bytes(ids[0, len(instance.prompt) :].tolist()).decode(errors="replace").split("\n")[0]


def test_answer_loss_is_the_teacher_forced_cross_entropy_of_answer_and_newline():
    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(vocab_size=256, d_model=16, n_heads=2, n_in=1, n_rec=1, n_out=1, max_seq_len=64)).eval()
    held = heldout_instances("addition", 2, 4) + heldout_instances("variables", 1, 3)
    for loops in (1, 3):
        total, count = 0.0, 0
        for instance in held:  # one token at a time: the prefix up to each answer token, its log-probability
            text = instance.prompt
            for char in instance.answer + "\n":
                logits = model(torch.tensor([list(text.encode())]), loops=loops)[0, -1]
                total -= torch.log_softmax(logits, -1)[ord(char)].item()
                count += 1
                text += char
        assert answer_loss(model, ByteTokenizer(), held, loops) == pytest.approx(total / count, rel=1e-5)
    with pytest.raises(ValueError, match="no instances"):
        answer_loss(model, ByteTokenizer(), [], 1)

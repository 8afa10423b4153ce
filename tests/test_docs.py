"""The documentation (README.md and the site under docs/) shows what the code does.

* The README's links point at files (``mkdocs build --strict`` checks the site's own).
* Every ``elr`` command line in a ``bash`` block parses with the command's own parser, so a renamed
  or removed flag fails here (what the commands then do is tested where each command is).
* Every message the troubleshooting page quotes is one the code raises.
* The code blocks of the guides run: the sampler of the extending guide trains from its YAML,
  the Python of the generation and checkpoints guides runs on a checkpoint, and the troubleshooting
  page's example prints the line it shows.
* Every figure a page quotes agrees with the results file it names (``docs/_tools/results.py``).
* Every ``from elr_lightning... import`` and ``::: elr_lightning...`` of the docs resolves at its
  current path (an old path the regroup left, ``elr_lightning._moved``, fails too).
* Every public name of the package has a docstring, as the API reference shows it (which renders
  only what has one), and ``generate`` documents each of its parameters.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import re
import shlex
import sys
import sysconfig
import textwrap
import warnings
from pathlib import Path
from typing import Any, Iterator

import jsonargparse
import pytest
import torch

from elr_lightning.cli import EXTRA_COMMANDS, main, run
from elr_lightning.errors import DEBUG_FLAG

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: Lightning's subcommands, besides :data:`EXTRA_COMMANDS`.
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


def pages() -> list[Path]:
    """The README and every page of the site."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks(page: Path, language: str) -> list[str]:
    """The fenced code blocks of ``language`` in ``page``, in order."""
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)


def block(page: Path, language: str, first_line: str) -> str:
    """The one block of ``language`` in ``page`` that starts with ``first_line``."""
    found = [b for b in blocks(page, language) if b.startswith(first_line)]
    assert len(found) == 1, f"{page.name} should have one {language} block starting {first_line!r}"
    return found[0]


def documented_commands() -> Iterator[tuple[str, list[str]]]:
    """``(where, argv)`` of every ``elr`` command of the docs' bash blocks that can run as written.

    Continuation lines are joined, comments dropped, optional ``[--flag value]`` parts kept and
    ``$STDLIB`` (the data guide's standard library folder) filled in. Lines with other shell variables,
    a pipe or CAPITAL placeholders (``--config FILE``) are templates, not commands; a ``--config`` of a
    file that is not in the repository is the user's own.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    for page in pages():
        for text in blocks(page, "bash"):
            for line in text.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                line = re.sub(r"\[(--[^\]]*)\]", r"\1", line).replace("$STDLIB", stdlib)
                if not line.startswith("elr ") or re.search(r"[$|]|\b[A-Z]{2,}\b", line):
                    continue
                argv = [a for a in shlex.split(line)[1:] if a != DEBUG_FLAG]  # main() takes it out
                configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
                if all((ROOT / c).is_file() for c in configs):
                    yield f"{page.relative_to(ROOT)}: {line}", argv


COMMANDS = dict(documented_commands())


class _Parsed(Exception):
    """Raised by the patched parsers once the command line has parsed."""


def _tool(name: str) -> Any:
    """A module of ``docs/_tools`` (not a package: the site's build and its maintainers run them as scripts)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"docs_tools_{name}", DOCS / "_tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quoted_figures_agree_with_the_results_files() -> None:
    """Each ``<!-- fig file.key ... -->`` span of a page renders as the JSON of ``docs/results/`` says."""
    results = _tool("results")
    quoted = [m for page in results.pages() for m, _ in results.markers(page.read_text())]
    assert len(quoted) >= 10
    assert results.sync(write=False) == []
    # Markdown reads an HTML comment that starts a line as a block of its own, splitting the paragraph.
    starts = [f"{page.name}: {line[:60]}" for page in results.pages() for line in page.read_text().splitlines()
              if line.startswith("<!-- fig")]
    assert not starts, starts


def test_results_fit_says_how_the_run_was_made_and_keeps_no_earlier_timings(tmp_path, monkeypatch) -> None:
    from torch.utils.tensorboard import SummaryWriter

    results = _tool("results")
    with SummaryWriter(str(tmp_path / "run")) as writer:
        for k, loss in ((1, 1.5), (2, 1.4)):
            writer.add_scalar(f"val/loss_k{k}", loss, 99)
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"about": "an earlier run", "cpu_s": 1.0, "wall_s": 2.0, "max_rss_gb": 3.0, "eval": {}}))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    results.main(["fit", str(tmp_path / "run"), str(out), "--wall_s", "7.5", "--about", "a test machine"])
    data = json.loads(out.read_text())
    assert data["about"].startswith("OMP_NUM_THREADS=1 elr fit;") and data["about"].endswith("; a test machine")
    assert data["wall_s"] == 7.5 and "cpu_s" not in data and "max_rss_gb" not in data  # this run's, or none
    assert data["validations"] == {"100": {"loss": {"1": 1.5, "2": 1.4}}} and "eval" in data  # other keys kept


def test_results_check_compares_a_rerun_within_the_stated_tolerances(tmp_path) -> None:
    results = _tool("results")
    quoted = json.loads((DOCS / "results" / "quickstart.json").read_text())
    (tmp_path / "quickstart.json").write_text(json.dumps(quoted))
    assert results.compare(str(tmp_path)) == []
    losses = dict(quoted["validations"]["800"]["loss"])

    def rerun(loss: dict, **more: float) -> None:
        quoted["validations"]["800"]["loss"] = loss
        (tmp_path / "quickstart.json").write_text(json.dumps({**quoted, **more}))

    rerun({k: v + results.TOLERANCES["loss"] * 0.9 for k, v in losses.items()}, cpu_s=1.0)
    assert results.compare(str(tmp_path)) == []  # within the tolerance, and timings are the machine's
    rerun({**losses, "1": losses["1"] + 2 * results.TOLERANCES["loss"]})
    wrong = results.compare(str(tmp_path))
    assert wrong and all("quickstart.validations.800.loss" in line and "tolerance 0.01" in line for line in wrong)
    with pytest.raises(SystemExit):
        results.main(["check", "--results", str(tmp_path)])


def test_every_public_name_has_a_docstring() -> None:
    """Names in ``__all__`` (else not starting with ``_``) and their classes' public methods, as the API reference
    sees them: an attribute's ``#:`` comment and an overridden method's docstring on its seam count."""
    griffe = pytest.importorskip("griffe")
    roles = _tool("sphinx_roles")
    package = griffe.load("elr_lightning", search_paths=[str(ROOT)], docstring_parser="google")
    missing = []

    def check(obj: Any) -> None:
        if obj.docstring is None and obj.is_attribute:
            roles._comment_docstring(obj)
        elif obj.docstring is None and obj.is_function and obj.parent.is_class:
            roles._inherited_docstring(obj)
        if obj.docstring is None and not any("override" in str(d.value) for d in getattr(obj, "decorators", [])):
            missing.append(obj.path)

    modules = [package]
    while modules:
        module = modules.pop()
        modules.extend(module.modules.values())
        names = module.exports if module.exports is not None else [n for n in module.members if not n.startswith("_")]
        for member in (module.members.get(str(name)) for name in names):
            if member is None or member.is_alias or member.is_module:
                continue
            check(member)
            if member.is_class:
                for name, method in member.members.items():
                    if not name.startswith("_") and method.is_function:
                        check(method)
    assert not missing, f"public names without a docstring: {missing}"


def test_generate_documents_every_parameter() -> None:
    import inspect

    from elr_lightning.inference.generate import generate

    documented = re.findall(r"^        (\w+):", generate.__doc__ or "", flags=re.M)
    assert documented == list(inspect.signature(generate).parameters)


def test_every_equation_number_links_to_the_equations_page() -> None:
    """"eq. N" in prose (not in code, headings or a link's own text) is a link to its equation on one page."""
    unlinked = []
    for page in pages():
        if page.name == "equations.md":
            continue
        fenced = False
        for line in page.read_text().splitlines():
            fenced ^= line.startswith("```")
            if fenced or line.startswith("#"):
                continue
            prose = re.sub(r"``.*?``|`[^`]*`|\[[^\]]*\]\([^)]*\)|<!--.*?-->", "", line)
            unlinked += [f"{page.name}: {line.strip()[:80]}" for _ in re.findall(r"\b[Ee]qs?\. \(?[1-5]", prose)]
    assert not unlinked, unlinked
    assert (DOCS / "equations.md").read_text().count('<a id="eq-') == 5


def documented_python_paths() -> Iterator[tuple[str, str, list[str]]]:
    """``(where, module, names)`` of every ``from elr_lightning... import ...``, ``import elr_lightning...``
    and ``::: elr_lightning...`` (an API reference block) of the README and the docs."""
    for page in pages():
        text = page.read_text()
        where = str(page.relative_to(ROOT))
        for found in re.finditer(r"^\s*from (elr_lightning[\w.]*) import (\([^)]*\)|[^\n]+)", text, flags=re.M):
            names = [n.split(" as ")[0].strip() for n in found.group(2).split("#")[0].strip("()").split(",")]
            yield where, found.group(1), [n for n in names if n]
        for found in re.finditer(r"^\s*import (elr_lightning[\w.]*)", text, flags=re.M):
            yield where, found.group(1), []
        for found in re.finditer(r"^::: (elr_lightning[\w.]*)", text, flags=re.M):
            yield where, found.group(1), []


def resolve(dotted: str) -> Any:
    """The module or object that ``dotted`` names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr)
        return found
    raise ModuleNotFoundError(dotted)


DOCUMENTED_PATHS = list(documented_python_paths())


def test_the_docs_name_python_paths_of_every_kind() -> None:
    assert {bool(names) for _, _, names in DOCUMENTED_PATHS} == {True, False}
    assert any(where.startswith("docs/reference/") for where, _, _ in DOCUMENTED_PATHS)


@pytest.mark.parametrize(("where", "module", "names"), DOCUMENTED_PATHS, ids=[f"{w}:{m}" for w, m, _ in DOCUMENTED_PATHS])
def test_every_documented_import_resolves_at_its_current_path(where: str, module: str, names: list[str]) -> None:
    """The docs show where a name lives now: an old, deprecated path (``elr_lightning._moved``) fails too."""
    with warnings.catch_warnings():
        # Only the alias table's warning: a third-party import (vLLM's use of torch.jit) may warn too.
        warnings.filterwarnings("error", message=r".* moved to .*; import from there", category=DeprecationWarning)
        found = resolve(module)
        for name in names:
            assert hasattr(found, name), f"{where}: {module} has no {name}"


def test_readme_links_point_at_files() -> None:
    """The README is not a page of the site, so ``mkdocs build --strict`` does not check its links."""
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [t for t in targets if "://" not in t]
    assert len(local) > 20
    assert not [t for t in local if not (ROOT / t).exists()]


def test_the_docs_show_commands_of_every_kind() -> None:
    shown = {argv[0] for argv in COMMANDS.values()}
    assert shown >= {"fit", "validate", "generate", "eval", "ablate", "cost", "prepare", "serve", "export"}
    assert shown <= set(EXTRA_COMMANDS) | set(LIGHTNING_COMMANDS), shown


@pytest.mark.parametrize("where", sorted(COMMANDS), ids=lambda where: re.sub(r"\W+", "-", where)[:90])
def test_documented_command_parses(where: str, monkeypatch, capsys) -> None:
    """Run the command until its parser has read the whole command line, then stop."""
    depth = {"calls": 0}

    def stopping(original: Any) -> Any:
        def parse_args(self: Any, *args: Any, **kwargs: Any) -> Any:
            depth["calls"] += 1
            try:
                parsed = original(self, *args, **kwargs)
            finally:
                depth["calls"] -= 1
            if depth["calls"] == 0:
                raise _Parsed
            return parsed

        return parse_args

    for cls in (argparse.ArgumentParser, jsonargparse.ArgumentParser):
        monkeypatch.setattr(cls, "parse_args", stopping(cls.parse_args))
    monkeypatch.chdir(ROOT)  # the paths of the docs are relative to the repository
    try:
        run(COMMANDS[where])
    except _Parsed:
        return
    except SystemExit as stop:  # --print_config prints the parsed config and exits
        assert stop.code in (0, None), capsys.readouterr().err
        return
    pytest.fail(f"{where}: the command ran without parsing its arguments")


def _raised_messages() -> list[str]:
    """Every message the package raises, f-string fields and other computed parts as ``<expression>``.

    Also the messages of exceptions built before they are raised (``return UnsafeCheckpointError(...)``,
    ``too_big = RequestError(...)``): every call of a class whose name ends in ``Error``.
    """

    def text(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(
                v.value if isinstance(v, ast.Constant) else f"<{ast.unparse(v.value)}>" for v in node.values
            )
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "text " + (a if c else b)
            left, right = text(node.left), text(node.right)
            if left is None and right is None:
                return None
            left = f"<{ast.unparse(node.left)}>" if left is None else left
            return left + (f"<{ast.unparse(node.right)}>" if right is None else right)
        return None

    def exception(node: ast.AST) -> ast.Call | None:
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            return node.exc
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("Error"):
            return node
        return None

    messages = []
    for path in sorted((ROOT / "elr_lightning").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            built = exception(node)
            if built is not None and built.args:
                message = text(built.args[0])
                if message:
                    messages.append(message)
    return messages


def _quoted_messages() -> list[str]:
    """The first column of every table row of the troubleshooting page, whose header is ``message``."""
    quoted, in_table = [], False
    for line in (DOCS / "troubleshooting.md").read_text().splitlines():
        if line.startswith("| message |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            cell = re.match(r"\| (``?)(.+?)\1 \|", line)
            assert cell, f"troubleshooting.md: a message row must start with a code span: {line}"
            quoted.append(cell.group(2))
    return quoted


def test_troubleshooting_quotes_messages_the_code_raises() -> None:
    messages = _raised_messages()
    quoted = _quoted_messages()
    assert len(quoted) > 50
    missing = []
    for text in quoted:
        pattern = ".+?".join(re.escape(part) for part in re.split(r"<[^<>]*>", text))
        if not any(re.search(pattern, message) for message in messages):
            missing.append(text)
    assert not missing, f"troubleshooting.md quotes messages no code raises: {missing}"


def test_troubleshooting_example_prints_its_line(monkeypatch, capsys) -> None:
    example = block(DOCS / "troubleshooting.md", "bash", "elr fit")
    command, shown = example.splitlines()[:2]
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stop:
        main(shlex.split(command)[1:])
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [shown.removeprefix("# ")]


def _command_line_rows() -> list[tuple[str, str]]:
    """``(command, line)`` of each row of the troubleshooting page's table of command-line mistakes."""
    text = (DOCS / "troubleshooting.md").read_text()
    table = text[text.index("| mistake | you type | elr prints |") :].split("\n\n")[0]
    return re.findall(r"^\| [^|]+ \| `(elr [^`]+)` \| `([^`]+)` \|$", table, flags=re.M)


@pytest.mark.parametrize("command, line", _command_line_rows(), ids=lambda v: re.sub(r"\W+", "-", v)[:60])
def test_each_command_line_mistake_prints_its_line(command: str, line: str, tmp_path, monkeypatch, capsys) -> None:
    """The command of each row, run as written, prints the row's line: an error as its one line, with status 1."""
    import socket

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("ELR_DEBUG", raising=False)
    argv = shlex.split(command)[1:]
    argv = [str(tmp_path / a) if a in ("prepared", "last.ckpt") else a for a in argv]
    with socket.socket() as holder:
        if "--port" in argv:  # the row is about a port another process holds
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", int(argv[argv.index("--port") + 1])))
            holder.listen()
        try:
            main(argv)
            code = 0
        except SystemExit as stop:
            code = stop.code
    said = [s for s in capsys.readouterr().err.splitlines() if s.startswith("elr")]
    assert said[0] == line.replace("last.ckpt", str(tmp_path / "last.ckpt"))
    if ": error: " in line:  # a notice of an old spelling does not stop the command
        assert code == 1 and len(said) == 1, said


def test_the_command_line_table_covers_every_kind_of_mistake() -> None:
    rows = _command_line_rows()
    assert len(rows) >= 11 and {command.split()[1] for command, _ in rows} >= {"fit", "generate", "serve", "prepare"}


@pytest.fixture
def my_lab(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """An empty package ``my_lab`` in ``tmp_path``, importable; no other test's ``my_lab`` before or after."""

    def forget() -> None:
        for name in [m for m in sys.modules if m == "my_lab" or m.startswith("my_lab.")]:
            del sys.modules[name]

    (tmp_path / "my_lab").mkdir()
    (tmp_path / "my_lab" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    forget()
    yield tmp_path / "my_lab"
    forget()


def test_extending_sampler_trains_from_its_yaml(my_lab: Path, tmp_path: Path, monkeypatch) -> None:
    """The ``my_lab/samplers.py`` block and its YAML, verbatim, in a run of three steps."""
    import yaml

    page = DOCS / "extending.md"
    (my_lab / "samplers.py").write_text(block(page, "python", "# my_lab/samplers.py"))
    model = yaml.safe_load(block(page, "yaml", "model:\n  class_path: elr_lightning.ELRModule\n  init_args:\n    sampler:"))
    model["model"]["init_args"].update(
        arch={"d_model": 32, "n_heads": 2, "n_in": 1, "n_rec": 1, "n_out": 1, "max_seq_len": 32, "max_loops": 3},
        warmup_steps=1,
    )
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": 3, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                    "limit_val_batches": 1, "default_root_dir": str(tmp_path)},
        **model,
        "data": {"class_path": "elr_lightning.data.TextDataModule",
                 "init_args": {"seq_len": 16, "batch_size": 4, "max_bytes": 20000, "cache_dir": str(tmp_path / "cache")}},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    from my_lab.samplers import Alternating

    seen: list[list[int]] = []
    original = Alternating.schedule
    monkeypatch.setattr(Alternating, "schedule", lambda self, *a: seen.append(original(self, *a)) or seen[-1])
    run(["fit", "--config", str(tmp_path / "run.yaml")])
    assert seen and all(s[0::2] == [1, 1] and len(set(s[1::2])) == 1 and s[1] in (2, 3) for s in seen), seen


@pytest.mark.parametrize("page", ["generation.md", "checkpoints.md"])
def test_python_of_the_guides_runs_on_a_checkpoint(page: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """Each ``python`` block of the page runs as written, on a tiny checkpoint at the path it names."""
    from _elr_ckpt import write_checkpoint

    from elr_lightning.tokenizers import ByteTokenizer
    from elr_lightning.updates import AdaptiveDelta

    code = blocks(DOCS / page, "python")
    assert code
    monkeypatch.chdir(tmp_path)
    for text in code:
        for path in set(re.findall(r"\"([\w/.-]+\.ckpt)\"", text)):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_checkpoint(Path(path), update=AdaptiveDelta(initial_step=0.5), tokenizer=ByteTokenizer())
        namespace: dict[str, Any] = {}
        exec(compile(textwrap.dedent(text), f"{page} python block", "exec"), namespace)
    if page == "generation.md":  # prints the decoded text and the loops of each of its 40 tokens
        assert capsys.readouterr().out.rstrip().endswith(str([3] * 40))
    else:
        update = namespace["raw"]["hyper_parameters"]["update"]  # plain data, not a pickled object
        assert update == {"class_path": "elr_lightning.updates.AdaptiveDelta",
                          "init_args": {"initial_step": 0.5}}
        assert torch.equal(namespace["module"].model.embed.weight, namespace["raw"]["state_dict"]["model.embed.weight"])

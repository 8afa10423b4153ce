"""Griffe extension: the docstrings' Sphinx roles become cross-references of the API reference.

The package's docstrings cite each other in reST (``:class:`~elr_lightning.data.TextDataModule```,
``:meth:`schedule```). mkdocstrings renders Markdown, so this extension rewrites each role, once the
whole package is loaded, into an autorefs link ``[`TextDataModule`][elr_lightning.data.TextDataModule]``
when it names a public object of ``elr_lightning`` (resolved from the docstring's scope, as Sphinx
does), and into plain code otherwise (torch, Lightning, builtins, private helpers). ``mkdocs build
--strict`` then fails on a role whose target was renamed or removed.
"""

from __future__ import annotations

import builtins
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj):`(?P<body>[^`]+)`")
#: reST's ``text::`` before an indented literal block; Markdown needs only the indentation.
LITERAL = re.compile(r"(\S)::\n[ \t]*\n")
#: An underscore that Markdown would read as the start of emphasis.
EMPHASIS = re.compile(r"(?<![\w\\`*])_(?=[^\s_])")
PACKAGE = "elr_lightning"


def _canonical(obj: griffe.Object, path: str) -> str:
    """Where the object ``path`` names is rendered: re-exports followed, an inherited member kept on the
    class that inherits it (``inherited_members`` renders it there), and an attribute without a docstring
    of its own on its class (whose ``Attributes`` section documents it; the reference renders only
    what has a docstring)."""
    head, _, member = path.rpartition(".")
    for owner, rest in ((path, ""), (head, member)):
        try:
            found = obj.package.get_member(owner.split(".", 1)[1]) if "." in owner else obj.package
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        if not rest and found.is_attribute and found.docstring is None and found.parent.is_class:
            return found.parent.canonical_path
        return f"{found.canonical_path}.{rest}" if rest else found.canonical_path
    return path  # not found: left for autorefs to report under --strict


def _in_scope(scope: griffe.Object, name: str) -> str | None:
    """The full path of ``name`` seen from ``scope``: its members (inherited ones included), imports, parents."""
    try:
        return scope.resolve(name)
    except (griffe.NameResolutionError, AttributeError):
        pass
    try:
        return f"{scope.path}.{name}" if scope.is_class and name in scope.all_members else None
    except griffe.AliasResolutionError:
        return None


def _target(obj: griffe.Object, name: str) -> str | None:
    """What ``name`` in ``obj``'s docstring links to: a full path in the package; None for what is not ours
    to link (torch, Lightning, builtins, private helpers); the bare name, which autorefs reports under
    ``--strict``, for a relative name that resolves nowhere (a renamed or removed object)."""
    name = name.lstrip(".").removesuffix("()")
    first, _, rest = name.partition(".")
    for scope in (obj, obj.parent):
        head = None if scope is None else _in_scope(scope, first)
        if head is not None:
            path = f"{head}.{rest}" if rest else head
            break
    else:
        if not rest and not hasattr(builtins, first):
            return name
        path = name
    parts = path.split(".")
    if parts[0] != PACKAGE or any(p.startswith("_") for p in parts):
        return None
    return _canonical(obj, path)


def _rewrite(obj: griffe.Object, text: str) -> str:
    def link(match: re.Match[str]) -> str:
        body = match.group("body")
        explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<name>[^>]+)>", body)
        if explicit:
            title, name = explicit.group("title"), explicit.group("name")
        else:
            name = body.lstrip("~")
            title = name.split(".")[-1] if body.startswith("~") else name
        target = _target(obj, name)
        return f"[`{title}`][{target}]" if target else f"`{title}`"

    return "\n".join(_escape_emphasis(line) for line in LITERAL.sub(r"\1:\n\n", ROLE.sub(link, text)).split("\n"))


def _escape_emphasis(line: str) -> str:
    """Keep the docstrings' plain-text maths (``s~_i``) from opening Markdown emphasis: a ``_`` that
    does not follow a letter is escaped, outside code spans and indented code."""
    if line.startswith("    "):
        return line
    parts = re.split(r"(``.*?``|`[^`]*`)", line)
    return "".join(p if i % 2 else EMPHASIS.sub(r"\\_", p) for i, p in enumerate(parts))


def _inherited_docstring(method: griffe.Object) -> None:
    """Give a method that overrides a documented one of a base class in the package that docstring: the
    seam's contract (``StateUpdate.forward``, ``DepthTask.draw``) is written once, on the seam."""
    try:
        bases = method.parent.mro()
    except (griffe.AliasResolutionError, ValueError, AttributeError):
        return
    for base in bases:
        member = base.members.get(method.name)
        if member is not None and base.path.startswith(PACKAGE) and member.docstring is not None:
            method.docstring = griffe.Docstring(member.docstring.value, lineno=member.docstring.lineno, parent=method)
            return


def _comment_docstring(attr: griffe.Object) -> None:
    """Give an attribute the Sphinx ``#:`` comment lines above it as its docstring."""
    lines = attr.module.lines
    if not lines or not attr.lineno:
        return
    comment: list[str] = []
    index = attr.lineno - 2
    while index >= 0 and lines[index].strip().startswith("#:"):
        comment.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    if comment:
        attr.docstring = griffe.Docstring(" ".join(comment), lineno=index + 2, parent=attr)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of the package once it is loaded (names resolve across modules then)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        objects = _walk(pkg)
        for obj in objects:  # first, so that a reference sees which attributes have a docstring
            if obj.docstring is None and obj.is_attribute:
                _comment_docstring(obj)
            elif obj.docstring is None and obj.is_function and obj.parent is not None and obj.parent.is_class:
                _inherited_docstring(obj)
        for obj in objects:
            if obj.docstring is not None:
                obj.docstring.value = _rewrite(obj, obj.docstring.value)


def _walk(pkg: griffe.Module) -> list[griffe.Object]:
    """Every object defined in the package, once (re-exports are aliases, not followed)."""
    seen: dict[str, griffe.Object] = {}
    stack: list[griffe.Object] = [pkg]
    while stack:
        obj = stack.pop()
        if obj.path not in seen:
            seen[obj.path] = obj
            stack.extend(m for m in obj.members.values() if not m.is_alias)
    return list(seen.values())

"""Every name the docs give exists: paths, modules, classes and their methods (README.md, docs/*.md).

A doc that still names ``psnode/worker.py`` after the file moved, or ``WorkerNode._push_small`` after
the method went to ``DataPath``, sends its reader to nothing. This test reads README.md and every
docs/*.md and resolves:

(a) paths ending in ``.py``, ``.sh``, ``.md``, ``.toml`` against the repository (links may be relative
    to docs/), and folders ending in ``/`` that start with a top-level folder (``psnode/worker/``);
(b) backticked dotted names of the project's packages (``psnode.worker.node.WorkerNode``,
    ``python -m benchmarks.call_path``): the longest module that is a file is imported and the rest
    looked up on it; ``benchmarks.*`` is never imported (its worker scripts need MXNet), its files
    are parsed instead;
(c) backticked ``module.attr`` / ``Class.attr`` whose first part is a module file or a class of
    psnode/, kvcore/, launcher/, pscontract/ or testkit/ (``dist_store.DistKVStore``,
    ``WorkerNode.push_part``); any module or class of that name that has the attribute will do, and
    a lowercase first part may also be a variable named after its class (``job.run_script``: an
    ``InProcJob``'s). A first part that is neither a module nor a class is no reference and is
    skipped, except the flat modules of the runtime's previous layout (``worker_data``,
    ``server_store``, ``zmq_transport`` ...), which are reported as such.

Inside fenced code blocks (user code) only ``from X import Y`` / ``import X`` of the project's
packages, ``python -m X`` and paths under the repository's top-level folders are checked. Options,
environment variables, URLs and absolute paths are not references.

Every unresolved reference is reported as FILE:LINE in one assertion message.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGES = ("psnode", "kvcore", "launcher", "pscontract", "testkit", "benchmarks")
SOURCE_PACKAGES = ("psnode", "kvcore", "launcher", "pscontract", "testkit")  # where rule (c) looks
TOP_FOLDERS = PACKAGES + ("tests", "examples", "docs", "scripts")
NOT_PROJECT_FILES = frozenset({
    "train.py", "trian.py", "x.py", "my_worker.py", "run.sh",  # the user's scripts in examples of commands
    "launch.py", "tools/launch.py",  # MXNet's and ps-lite's launcher
})
RETIRED_MODULES = frozenset({  # the runtime's flat modules before psnode was split into packages
    "worker_data", "worker_requests", "worker_outbox", "worker_receiver", "worker_process",
    "server_store", "server_replies", "server_groups", "server_checkpoint", "scheduler_report",
    "zmq_transport", "inproc_transport", "checkpoint_file", "nccl_group", "shm", "heap", "envcontract",
})
FILE_SUFFIXES = frozenset({"py", "sh", "md", "toml", "json", "txt", "bin", "png", "svg", "html", "yaml", "yml",
                           "cfg", "ini", "log", "csv", "gz", "tar", "so", "c", "h", "pkl", "npz", "npy"})

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S*")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_PATH = re.compile(r"(?<![\w./*<>{}$~@:-])((?:\.\.?/)*(?:[\w-][\w.-]*/)*[\w-][\w.-]*\.(?:py|sh|md|toml))(?![\w/*<>-])")
_FOLDER = re.compile(r"(?<![\w./*<>{}$~@:-])((?:%s)/(?:[\w-][\w.-]*/)*)(?![\w.*<>{-])" % "|".join(TOP_FOLDERS))
_DOTTED = re.compile(r"(?<![\w.$/@-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/@-]|\.\w)")
_RUN_MODULE = re.compile(r"\bpython[\d.]*\s+-m\s+([A-Za-z_][\w.]*)")
_FROM_IMPORT = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+\(?([\w\s,]+?)\)?\s*(?:#.*)?$")
_IMPORT = re.compile(r"^\s*import\s+([\w.]+(?:\s*,\s*[\w.]+)*)\s*(?:#.*)?$")


# ---- the project's files, modules and classes ---------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _project_files() -> dict[str, list[Path]]:
    """Every file under the top-level folders, by name."""
    found: dict[str, list[Path]] = {}
    for top in TOP_FOLDERS:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                found.setdefault(path.name, []).append(path)
    return found


@functools.lru_cache(maxsize=None)
def _output_folders() -> tuple[str, ...]:
    """Folders .gitignore keeps out of the repository (``benchmarks/results/``): what scripts write there
    is output, not a file of the project."""
    folders = []
    for line in (ROOT / ".gitignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and line.endswith("/") and "*" not in line:
            folders.append(line)  # "/benchmarks/results/": at the top only; "build/": anywhere
    return tuple(folders)


def _is_output(path: str) -> bool:
    return any(path.startswith(folder[1:]) if folder.startswith("/") else f"/{folder}" in f"/{path}"
               for folder in _output_folders())


def _module_file(dotted: str) -> Path | None:
    """The file of module ``dotted`` in this repository (a package's ``__init__.py``), or None."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def _index() -> tuple[dict[str, list[str]], dict[str, list[tuple[str, str]]]]:
    """``(modules, classes)``: module names by their last part (``node`` -> ``psnode.worker.node`` ...),
    and ``(module, class)`` pairs by class name, for every module of ``SOURCE_PACKAGES``."""
    modules: dict[str, list[str]] = {}
    classes: dict[str, list[tuple[str, str]]] = {}
    for package in SOURCE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name = _module_name(path)
            modules.setdefault(name.rsplit(".", 1)[-1], []).append(name)
            for node in _parse(path).body:
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, []).append((name, node.name))
    return modules, classes


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _top_level_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body binds (defs, classes, assignments, imports), through if/try blocks."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):
            inner = node.body + node.orelse + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            names.update(_top_level_names(inner))
    return names


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes a class's methods set on ``self`` (instance attributes no ``getattr`` on the class finds)."""
    found = set()
    for node in ast.walk(cls):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    found.add(leaf.attr)
    return found


def _class_node(cls: type) -> ast.ClassDef | None:
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return None
    if path is None or not Path(path).resolve().is_relative_to(ROOT):
        return None
    for node in ast.walk(_parse(Path(path).resolve())):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    return None


# ---- resolving one name -------------------------------------------------------------------------------


class _Unresolved(Exception):
    pass


def _lookup(obj: Any, name: str) -> tuple[bool, Any]:
    """``(found, value)`` of attribute ``name`` of ``obj`` (a module, class or other object); the value is
    None when the attribute exists but only on instances (set in a method, a dataclass field)."""
    if hasattr(obj, name):
        return True, getattr(obj, name)
    if inspect.ismodule(obj) and hasattr(obj, "__path__") and _module_file(f"{obj.__name__}.{name}") is not None:
        return True, importlib.import_module(f"{obj.__name__}.{name}")
    if inspect.isclass(obj):
        for klass in obj.__mro__:
            if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "__dataclass_fields__", {}):
                return True, None
            node = _class_node(klass)
            if node is not None and name in _self_attributes(node):
                return True, None
    return False, None


def _describe(obj: Any) -> str:
    if inspect.ismodule(obj):
        return obj.__name__
    if inspect.isclass(obj):
        return f"{obj.__module__}.{obj.__qualname__}"
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def _resolve_on(obj: Any, parts: list[str]) -> None:
    for part in parts:
        found, value = _lookup(obj, part)
        if not found:
            raise _Unresolved(f"{_describe(obj)} has no {part!r}")
        if value is None:  # an instance attribute: what it holds is not known here
            return
        obj = value


def _resolve_in_file(path: Path, parts: list[str]) -> None:
    """Look ``parts`` up in a module's source without importing it (benchmarks, missing libraries)."""
    names = _top_level_names(_parse(path).body)
    scope = "the module"
    for part in parts:
        node = names.get(part)
        if node is None:
            raise _Unresolved(f"{path.relative_to(ROOT)}: {scope} defines no {part!r}")
        if not isinstance(node, ast.ClassDef):
            return
        names = _top_level_names(node.body)
        names.update({n: ast.Pass() for n in _self_attributes(node)})  # instance attributes: found, no deeper
        scope = f"class {node.name}"


def _import(module: str) -> Any:
    """The module, or None when it cannot be imported for want of a library from outside the project."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in PACKAGES:
            raise _Unresolved(f"importing {module} fails: {exc}") from None
        return None


def resolve_dotted(name: str) -> None:
    """Rule (b): ``name`` starts with one of the project's packages.

    Raises:
        _Unresolved: why not.
    """
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        path = _module_file(module)
        if path is None:
            continue
        if parts[0] == "benchmarks":
            _resolve_in_file(path, parts[i:])
            return
        obj = _import(module)
        if obj is None:
            _resolve_in_file(path, parts[i:])
        else:
            _resolve_on(obj, parts[i:])
        return
    raise _Unresolved(f"no module {parts[0]} in the repository")


def resolve_module(name: str) -> None:
    """``name`` must be a module (``python -m name``, ``import name``)."""
    if _module_file(name) is None:
        raise _Unresolved(f"no module {name} (no {name.replace('.', '/')}.py or package)")


def resolve_short(name: str) -> bool:
    """Rule (c): ``module.attr`` or ``Class.attr`` of the project. False when the first part is neither
    a module nor a class of the project (no reference)."""
    parts = name.split(".")
    modules, classes = _index()
    if parts[0] in RETIRED_MODULES and parts[0] not in modules and parts[0] not in classes:
        raise _Unresolved(f"{parts[0]} is a module of the runtime's previous layout")
    candidates: list[tuple[str, str | None]] = [(m, None) for m in modules.get(parts[0], [])]
    candidates += classes.get(parts[0], [])
    if not candidates:
        return False
    if parts[0].islower():  # also a variable named after its class, as code names them (``job``: an InProcJob)
        candidates += [pair for class_name, pairs in sorted(classes.items())
                       if class_name.lower().endswith(parts[0]) for pair in pairs]
    reasons = []
    for module, cls in candidates:
        try:
            obj = _import(module)
            if obj is None:
                _resolve_in_file(_module_file(module), ([cls] if cls else []) + parts[1:])
            else:
                if cls is not None:
                    obj = getattr(obj, cls)
                _resolve_on(obj, parts[1:])
            return True
        except _Unresolved as exc:
            reasons.append(str(exc))
    where = ", ".join(f"{m}.{c}" if c else m for m, c in candidates)
    raise _Unresolved(f"not an attribute of {where} ({'; '.join(reasons)})")


def resolve_path(path: str, doc: Path, in_code: bool) -> bool:
    """Rule (a). False when ``path`` is no reference to check (a user's file in an example, output)."""
    if path.startswith("./"):
        path = path[2:]
    if path in NOT_PROJECT_FILES or _is_output(path):
        return False
    if "/" not in path:
        if in_code:  # a bare name in a code block: a file of the user's
            return False
    elif in_code and path.split("/")[0] not in TOP_FOLDERS:
        return False
    for base in (ROOT, doc.parent, DOCS):
        if (base / path).exists():
            return True
    name = path.rsplit("/", 1)[-1]
    if any(str(found.relative_to(ROOT)).endswith(path) for found in _project_files().get(name, [])):
        return True  # named by its file name (``dist_store.py``) or its last folders (``dist_scripts/sums.py``)
    raise _Unresolved("no such file in the repository")


# ---- reading a doc --------------------------------------------------------------------------------------


def _lines(text: str) -> Iterator[tuple[int, str, str | None]]:
    """``(line number, line, fence language or None outside fences)``; fence lines themselves are skipped."""
    fence: str | None = None
    language = ""
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if match is not None:
            if fence is None:
                fence, language = match.group(1)[0] * 3, match.group(2).lower()
                continue
            if match.group(1).startswith(fence) and not match.group(2):
                fence = None
                continue
        yield number, line, (language if fence is not None else None)


def _is_not_a_name(span: str) -> bool:
    """An option, an environment assignment or a bare environment variable: no reference inside."""
    span = span.strip()
    return span.startswith("-") or re.fullmatch(r"[A-Z][A-Z0-9_]*(=\S*)?", span) is not None


def _prose_references(start: int, lines: list[str]) -> Iterator[tuple[int, str, str, bool]]:
    """Modules run with ``python -m`` and dotted names in code spans of one paragraph (a span may
    go on over a line break, as Markdown allows)."""
    text = _URL.sub(" ", "\n".join(lines))

    def line_of(offset: int) -> int:
        return start + text.count("\n", 0, offset)

    for match in _RUN_MODULE.finditer(text):
        if match.group(1).split(".")[0] in PACKAGES:
            yield line_of(match.start(1)), "module", match.group(1).rstrip("."), False
    for span_match in _CODE_SPAN.finditer(text):
        span = span_match.group(2)
        if _is_not_a_name(span):
            continue
        for match in _DOTTED.finditer(span):
            name = match.group(1)
            if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                continue  # a file name (``launcher.md``): rule (a)'s
            if re.search(r"-m\s+" + re.escape(name) + r"\b", span):
                continue  # ``python -m benchmarks.run``: taken as a module above
            yield line_of(span_match.start(2) + match.start(1)), "name", name, False


def _import_references(number: int, line: str) -> Iterator[tuple[int, str, str, bool]]:
    """``from X import Y`` and ``import X`` of the project's packages in a code block."""
    match = _FROM_IMPORT.match(line)
    if match is not None and match.group(1).split(".")[0] in PACKAGES:
        module = match.group(1)
        yield number, "module", module, True
        for item in match.group(2).split(","):
            item = item.strip().split(" as ")[0].strip()
            if item and item != "*":
                yield number, "name", f"{module}.{item}", True
        return
    match = _IMPORT.match(line)
    if match is not None:
        for item in match.group(1).split(","):
            item = item.strip().split(" as ")[0].strip()
            if item.split(".")[0] in PACKAGES:
                yield number, "module", item, True


def references(text: str, doc: Path) -> Iterator[tuple[int, str, str, bool]]:
    """``(line, kind, reference, in_code)`` for every reference in a doc's text."""
    paragraph: list[str] = []
    paragraph_start = 0
    pending = ""  # a parenthesised import of a code block, until its ``)``
    for number, line, language in _lines(text):
        in_code = language is not None
        if paragraph and (in_code or not line.strip() or number != paragraph_start + len(paragraph)):
            yield from _prose_references(paragraph_start, paragraph)
            paragraph = []
        bare = _URL.sub(" ", line)
        for match in _PATH.finditer(bare):
            yield number, "path", match.group(1), in_code
        for match in _FOLDER.finditer(bare):
            yield number, "folder", match.group(1), in_code
        if not in_code:
            if line.strip():
                if not paragraph:
                    paragraph_start = number
                paragraph.append(line)
            continue
        for match in _RUN_MODULE.finditer(bare):
            if match.group(1).split(".")[0] in PACKAGES:
                yield number, "module", match.group(1).rstrip("."), True
        if language in ("python", "py", "python3", "pycon", ""):
            if pending:
                pending += " " + line.strip()
                if ")" in line:
                    yield from _import_references(number, pending)
                    pending = ""
            elif re.match(r"^\s*from\s+[\w.]+\s+import\s*\([^)]*$", line):
                pending = line.strip()
            else:
                yield from _import_references(number, line)
    if paragraph:
        yield from _prose_references(paragraph_start, paragraph)


def scan_text(doc_name: str, text: str) -> list[str]:
    """Every unresolved reference of a doc's ``text`` as ``FILE:LINE: `reference`: why``."""
    doc = ROOT / doc_name
    problems = []
    seen: set[tuple[int, str, str]] = set()
    for number, kind, ref, in_code in references(text, doc):
        if (number, kind, ref) in seen:
            continue
        seen.add((number, kind, ref))
        try:
            if kind == "path":
                resolve_path(ref, doc, in_code)
            elif kind == "folder":
                if not (ROOT / ref).is_dir() and not _is_output(ref):
                    raise _Unresolved("no such folder in the repository")
            elif kind == "module":
                resolve_module(ref)
            elif ref.split(".")[0] in PACKAGES:
                resolve_dotted(ref)
            else:
                resolve_short(ref)
        except _Unresolved as exc:
            problems.append(f"{doc_name}:{number}: `{ref}`: {exc}")
    return problems


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


# ---- the tests --------------------------------------------------------------------------------------------


def test_every_reference_in_the_docs_resolves():
    problems = []
    for path in _docs():
        problems += scan_text(str(path.relative_to(ROOT)), path.read_text())
    assert not problems, f"{len(problems)} references in the docs name nothing:\n" + "\n".join(problems)


def test_the_scanner_reports_bad_references():
    text = "\n".join([
        "The worker is in `psnode/worker/node.py` (`psnode.worker.node.WorkerNode`, `WorkerNode.push_part`),",
        "not in psnode/worker.py nor in `psnode.nosuch.thing`; see [env](env.md), not [gone](gone.md).",
        "`worker_data.DataPath` and `WorkerNode._push_small` are gone; `kv.push` and `--dry-run` are no references.",
        "Folders: `psnode/worker/` exists, `psnode/nowhere/` does not; `python -m benchmarks.no_such_benchmark`.",
        "A code span may go on over a line break, `as this one",
        "does: psnode.worker.gone`, and `python -m",
        "benchmarks.call_path` is a module run across one.",
        "```python",
        "from psnode.worker.node import WorkerNode, NoSuchThing",
        "import my_own_module",
        "run('train.py')",
        "```",
    ])
    problems = scan_text("docs/made_up.md", text)
    reported = {p.split(": ", 1)[0] + " " + p.split("`")[1] for p in problems}
    assert reported == {
        "docs/made_up.md:2 psnode/worker.py",
        "docs/made_up.md:2 psnode.nosuch.thing",
        "docs/made_up.md:2 gone.md",
        "docs/made_up.md:3 worker_data.DataPath",
        "docs/made_up.md:3 WorkerNode._push_small",
        "docs/made_up.md:4 psnode/nowhere/",
        "docs/made_up.md:4 benchmarks.no_such_benchmark",
        "docs/made_up.md:6 psnode.worker.gone",
        "docs/made_up.md:9 psnode.worker.node.NoSuchThing",
    }, "\n".join(problems)

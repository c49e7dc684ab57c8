"""docs/configuration.md lists every environment variable the console reads, and nothing it does not read.

The names come from the code, never from a list kept here: the syntax tree of every module of the console's apps
(console/settings.py, the helpers it calls, `manage.py serve`, console/asgi.py, ...). A read is `os.environ.get(X)`,
`os.environ[X]`, `X in os.environ`, `os.getenv(X)`, an iteration over `os.environ` filtered by `startswith(P)` (a
family of variables, listed as `P<NAME>`), or a call to a *reader*: a function of those modules that reads a
variable named by its arguments (console/env.py's `env_int("PORT", 8000)`, console/schedules.py's
`periodic_from_env("SLA_SWEEP", ...)`, which reads SLA_SWEEP_SECONDS and SLA_SWEEP_CRON). A use of `os.environ`
the collector does not understand, or a name it cannot work out, fails the test: teach the collector, rather than
let a variable slip past the documentation. `os.environ.setdefault` and writes set values for libraries; they read
nothing a person sets.

The rows under the heading "Read by uvicorn" are the web server's library's own: each must be read by
uvicorn's config module, found the same way.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
APPS = ("console", "core", "jobs", "runs", "approvals", "external", "slackapp", "demo")
UVICORN_HEADING = "Read by uvicorn"


# --- The code: which variables it reads ------------------------------------------------------------------------


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _is_getenv(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "getenv"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


@dataclass
class Module:
    name: str
    path: Path  # relative to the directory its package is in, for messages
    tree: ast.Module
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    constants: dict[str, ast.expr] = field(default_factory=dict)  # module-level NAME = "literal"
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted name it stands for

    @classmethod
    def parse(cls, name: str, path: Path) -> Module:
        base = path.parents[name.count(".") + (path.name == "__init__.py")]
        module = cls(name, path.relative_to(base), ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for node in ast.walk(module.tree):
            for child in ast.iter_child_nodes(node):
                module.parents[child] = node
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    module.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        module.imports[alias.asname] = alias.name
        for statement in module.tree.body:
            if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Constant):
                for target in statement.targets:
                    if isinstance(target, ast.Name):
                        module.constants[target.id] = statement.value
        return module

    def where(self, node: ast.AST) -> str:
        return f"{self.path}:{node.lineno}"

    def enclosing(self, node: ast.AST, kind) -> ast.AST | None:
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, kind):
                return node
        return None


def _local_assignments(function: ast.FunctionDef | ast.AsyncFunctionDef | None) -> dict[str, ast.expr]:
    """`name = expr` and `a, b = x, y` in a function's body: enough to follow a name to the string it holds."""
    found: dict[str, ast.expr] = {}
    if function is None:
        return found
    for node in ast.walk(function):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name):
                found[target.id] = node.value
            elif (
                isinstance(target, ast.Tuple)
                and isinstance(node.value, ast.Tuple)
                and len(target.elts) == len(node.value.elts)
            ):
                for name, value in zip(target.elts, node.value.elts, strict=True):
                    if isinstance(name, ast.Name):
                        found[name.id] = value
    return found


class Unknown(Exception):
    pass


def _evaluate(expr: ast.expr, bindings: dict, assignments: dict[str, ast.expr], module: Module) -> str:
    """The string `expr` names, given the values of a reader's parameters (`bindings`); Unknown otherwise."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.Name):
        if expr.id in bindings:
            if bindings[expr.id] is None:
                raise Unknown(expr.id)
            return bindings[expr.id]
        if expr.id in assignments:
            return _evaluate(assignments[expr.id], bindings, assignments, module)
        if expr.id in module.constants:
            return _evaluate(module.constants[expr.id], bindings, assignments, module)
        raise Unknown(expr.id)
    if isinstance(expr, ast.JoinedStr):
        parts = []
        for value in expr.values:
            if isinstance(value, ast.FormattedValue) and value.conversion == -1 and value.format_spec is None:
                parts.append(_evaluate(value.value, bindings, assignments, module))
            else:
                parts.append(_evaluate(value, bindings, assignments, module))
        return "".join(parts)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return _evaluate(expr.left, bindings, assignments, module) + _evaluate(
            expr.right, bindings, assignments, module
        )
    raise Unknown(ast.unparse(expr))


def _names_in(expr: ast.expr, assignments: dict[str, ast.expr], seen: frozenset = frozenset()) -> set[str]:
    names = set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and node.id not in seen:
            names.add(node.id)
            if node.id in assignments:
                names |= _names_in(assignments[node.id], assignments, seen | {node.id})
    return names


@dataclass
class Reads:
    names: dict[str, str] = field(default_factory=dict)  # variable -> where it is read (one place)
    prefixes: dict[str, str] = field(default_factory=dict)  # WEBHOOK_SECRET_ -> where
    problems: list[str] = field(default_factory=list)

    def add(self, name: str, where: str) -> None:
        self.names.setdefault(name, where)


def _iterated_environ(module: Module, node: ast.AST) -> bool:
    """Whether `node` is a name bound by a comprehension over os.environ that encloses it (its reads are that
    iteration's, whose prefix is counted once)."""
    if not isinstance(node, ast.Name):
        return False
    scope = node
    while (scope := module.enclosing(scope, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp))) is not None:
        for generator in scope.generators:
            if _environ_iteration(generator) and node.id in _names_in(generator.target, {}):
                return True
    return False


def _environ_iteration(generator: ast.comprehension) -> bool:
    iterated = generator.iter
    if isinstance(iterated, ast.Call) and isinstance(iterated.func, ast.Attribute) and iterated.func.attr == "keys":
        iterated = iterated.func.value
    return _is_environ(iterated)


def _read_sites(module: Module) -> list[tuple[ast.AST, ast.expr | None, str]]:
    """Every use of os.environ or os.getenv in the module: (node, the expression naming the variable read, kind).
    kind: "read", "prefix" (the expression is the prefix), "ignored" (a write, setdefault, a spread into a child's
    environment, a name bound by a filtered iteration), or "unknown"."""
    sites = []
    for node in ast.walk(module.tree):
        if _is_getenv(node):
            call = module.parents.get(node)
            if isinstance(call, ast.Call) and call.func is node and call.args:
                sites.append((call, call.args[0], "read"))
            else:
                sites.append((node, None, "unknown"))
            continue
        if not _is_environ(node):
            continue
        parent = module.parents.get(node)
        grandparent = module.parents.get(parent)
        if isinstance(parent, ast.Attribute) and isinstance(grandparent, ast.Call) and grandparent.func is parent:
            if parent.attr in ("get", "pop") and grandparent.args:
                sites.append((grandparent, grandparent.args[0], "read"))
                continue
            if parent.attr == "setdefault":  # a default for a library (DJANGO_SETTINGS_MODULE): nothing to set
                sites.append((grandparent, None, "ignored"))
                continue
            if parent.attr == "keys" and isinstance(module.parents.get(grandparent), ast.comprehension):
                parent = module.parents[grandparent]  # judged as the iteration below
        if isinstance(parent, ast.Subscript) and parent.value is node:
            if isinstance(parent.ctx, ast.Load):
                sites.append((parent, parent.slice, "read"))
            else:
                sites.append((parent, None, "ignored"))  # a write, for a child process or a library
        elif isinstance(parent, ast.Compare) and node in parent.comparators:
            if all(isinstance(op, (ast.In, ast.NotIn)) for op in parent.ops):
                sites.append((parent, parent.left, "read"))
            else:
                sites.append((parent, None, "unknown"))
        elif isinstance(parent, ast.Dict) and any(
            key is None and value is node for key, value in zip(parent.keys, parent.values, strict=True)
        ):
            sites.append((parent, None, "ignored"))  # {**os.environ, ...}: a child process's environment
        elif isinstance(parent, ast.comprehension) and _environ_iteration(parent):
            target = parent.target
            prefix = None
            for condition in parent.ifs:
                for test in ast.walk(condition):
                    if (
                        isinstance(test, ast.Call)
                        and isinstance(test.func, ast.Attribute)
                        and test.func.attr == "startswith"
                        and isinstance(test.func.value, ast.Name)
                        and isinstance(target, ast.Name)
                        and test.func.value.id == target.id
                        and test.args
                    ):
                        prefix = test.args[0]
            sites.append((parent.iter, prefix, "prefix" if prefix is not None else "unknown"))
        else:
            sites.append((node, None, "unknown"))
    return sites


def _function_of(module: Module, node: ast.AST):
    return module.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef))


def _parameters(function) -> list[str]:
    arguments = function.args
    return [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]


def collect(modules: list[Module], *, strict: bool = True) -> Reads:
    """The variables these modules read, directly or through their readers."""
    reads = Reads()
    # Readers: module-level functions with a read whose variable is named by a parameter.
    readers: dict[str, tuple[Module, ast.FunctionDef, list[ast.expr]]] = {}
    direct: list[tuple[Module, ast.AST, ast.expr, str]] = []
    for module in modules:
        for node, name_expr, kind in _read_sites(module):
            function = _function_of(module, node)
            if kind == "unknown":
                if strict:
                    reads.problems.append(f"{module.where(node)}: a use of os.environ this test does not understand")
                continue
            if kind == "ignored" or _iterated_environ(module, name_expr):
                continue
            if (
                kind == "read"
                and function is not None
                and module.enclosing(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) is None
                and _names_in(name_expr, _local_assignments(function)) & set(_parameters(function))
            ):
                key = f"{module.name}.{function.name}"
                readers.setdefault(key, (module, function, []))[2].append(name_expr)
                continue
            direct.append((module, node, name_expr, kind))
    for module, node, name_expr, kind in direct:
        function = _function_of(module, node)
        try:
            name = _evaluate(name_expr, {}, _local_assignments(function), module)
        except Unknown:
            if strict:
                reads.problems.append(f"{module.where(node)}: cannot tell which variable {ast.unparse(name_expr)} is")
            continue
        (reads.prefixes if kind == "prefix" else reads.names).setdefault(name, module.where(node))
    # Calls to readers, anywhere in these modules.
    for module in modules:
        for call in ast.walk(module.tree):
            if not isinstance(call, ast.Call):
                continue
            key = _callee(module, call.func, readers)
            if key is None:
                continue
            reader_module, function, name_exprs = readers[key]
            if any(_iterated_environ(module, argument) for argument in call.args):
                continue  # env_list(name) inside `... for name in os.environ if name.startswith(P)`: P counts
            bindings = _bind(function, call, module, _local_assignments(_function_of(module, call)))
            for name_expr in name_exprs:
                try:
                    name = _evaluate(name_expr, bindings, _local_assignments(function), reader_module)
                except Unknown:
                    if strict:
                        reads.problems.append(
                            f"{module.where(call)}: cannot tell which variable {ast.unparse(call)} reads"
                        )
                    continue
                reads.add(name, module.where(call))
    return reads


def _callee(module: Module, func: ast.expr, readers: dict) -> str | None:
    if isinstance(func, ast.Name):
        if f"{module.name}.{func.id}" in readers:
            return f"{module.name}.{func.id}"
        dotted = module.imports.get(func.id)
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in module.imports:
        dotted = f"{module.imports[func.value.id]}.{func.attr}"
    else:
        return None
    return dotted if dotted in readers else None


def _bind(function, call: ast.Call, module: Module, caller_assignments: dict) -> dict:
    """The reader's parameters bound to the call's arguments, each the string it names or None."""

    def value(expr):
        try:
            return _evaluate(expr, {}, caller_assignments, module)
        except Unknown:
            return None

    positional = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
    bindings: dict = dict.fromkeys(_parameters(function))
    defaults = function.args.defaults
    for name, default in zip(positional[len(positional) - len(defaults) :], defaults, strict=True):
        bindings[name] = value(default)
    for name, default in zip([a.arg for a in function.args.kwonlyargs], function.args.kw_defaults, strict=True):
        if default is not None:
            bindings[name] = value(default)
    for name, argument in zip(positional, call.args, strict=False):
        bindings[name] = value(argument)
    for keyword in call.keywords:
        if keyword.arg in bindings:
            bindings[keyword.arg] = value(keyword.value)
    return bindings


def console_modules() -> list[Module]:
    modules = []
    for app in APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            modules.append(Module.parse(name, path))
    return modules


def uvicorn_config() -> Module:
    return Module.parse("uvicorn.config", Path(importlib.util.find_spec("uvicorn.config").origin))


# --- The document: which variables it lists --------------------------------------------------------------------

VARIABLE = re.compile(r"`([A-Z][A-Z0-9_]*(?:<[A-Z]+>)?)`")


@dataclass
class Row:
    name: str  # `WEBHOOK_SECRET_<SOURCE>` stands for its prefix, WEBHOOK_SECRET_
    line: int
    uvicorn: bool  # under the heading "Read by uvicorn"

    @property
    def prefix(self) -> str | None:
        return self.name.partition("<")[0] if "<" in self.name else None


def documented(text: str) -> list[Row]:
    """The variables the first column of the document's tables names."""
    rows, section = [], ""
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.startswith("|") and not set(line) <= set("|-: "):
            first_cell = line.split("|")[1]
            uvicorn = section.startswith(UVICORN_HEADING)
            rows += [Row(name, number, uvicorn) for name in VARIABLE.findall(first_cell)]
    return rows


def listed(*, uvicorn: bool = False) -> list[Row]:
    return [row for row in documented(DOC.read_text(encoding="utf-8")) if row.uvicorn == uvicorn]


# --- The tests -------------------------------------------------------------------------------------------------


def test_the_collector_understands_every_read():
    reads = collect(console_modules())
    assert not reads.problems, "\n".join(reads.problems)
    # It finds the readers' variables, not only literal os.environ reads: a collector that found nothing would
    # pass a document that lists nothing.
    assert {"DATABASE_URL", "PORT", "WEB_THREADS", "SLA_SWEEP_SECONDS", "SLA_SWEEP_CRON"} <= set(reads.names)
    assert set(reads.prefixes) == {"WEBHOOK_SECRET_"}


def test_the_collector_finds_every_form_of_read(tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "env.py").write_text(
        "import os\n"
        "def env_flag(name, default=False):\n"
        "    return os.environ.get(name, default)\n"
        "def periodic(prefix):\n"
        "    seconds, cron = f'{prefix}_SECONDS', f'{prefix}_CRON'\n"
        "    return os.environ[seconds], cron in os.environ\n"
    )
    (tmp_path / "app" / "settings.py").write_text(
        "import os\n"
        "from app.env import env_flag\n"
        "from app import env as helpers\n"
        "KEY = 'KEY_VARIABLE'\n"
        "A = env_flag('FLAG_A')\n"
        "B = helpers.periodic(prefix='SWEEP')\n"
        "C = os.getenv('GETENV') or os.environ.get(KEY) or os.environ.pop('POPPED', '')\n"
        "D = {n[4:]: env_flag(n) for n in os.environ if n.startswith('SRC_')}\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'x')\n"
        "os.environ['WRITTEN'] = '1'\n"
        "child = {**os.environ, 'X': '1'}\n"
    )
    modules = [Module.parse(f"app.{name}", tmp_path / "app" / f"{name}.py") for name in ("env", "settings")]
    reads = collect(modules)
    assert reads.problems == []
    assert set(reads.names) == {"FLAG_A", "SWEEP_SECONDS", "SWEEP_CRON", "GETENV", "KEY_VARIABLE", "POPPED"}
    assert set(reads.prefixes) == {"SRC_"}
    (tmp_path / "app" / "settings.py").write_text(
        "import os\nfrom app.env import env_flag\nenviron = os.environ\nE = env_flag(os.environ['X'] + 'Y')\n"
    )
    problems = collect([modules[0], Module.parse("app.settings", tmp_path / "app" / "settings.py")]).problems
    assert [problem.split(": ", 1)[1] for problem in problems] == [
        "a use of os.environ this test does not understand",
        "cannot tell which variable env_flag(os.environ['X'] + 'Y') reads",
    ]


def test_the_document_lists_every_variable_the_console_reads():
    reads = collect(console_modules())
    names = {row.name for row in listed()}
    prefixes = {row.prefix for row in listed() if row.prefix}
    missing = [f"{name} ({where})" for name, where in reads.names.items() if name not in names]
    missing += [f"{prefix}<...> ({where})" for prefix, where in reads.prefixes.items() if prefix not in prefixes]
    assert not missing, "read by the code, not in docs/configuration.md:\n  " + "\n  ".join(sorted(missing))


def test_the_document_lists_nothing_the_console_does_not_read():
    reads = collect(console_modules())
    extra = [
        f"{row.name} (line {row.line})"
        for row in listed()
        if (row.prefix not in reads.prefixes if row.prefix else row.name not in reads.names)
    ]
    assert not extra, "in docs/configuration.md, read by no code of the console:\n  " + "\n  ".join(extra)


def test_what_the_document_says_uvicorn_reads_uvicorn_reads():
    rows = listed(uvicorn=True)
    assert rows, f'docs/configuration.md has no "{UVICORN_HEADING}" table'
    reads = collect([uvicorn_config()], strict=False)
    unread = [f"{row.name} (line {row.line})" for row in rows if row.name not in reads.names]
    assert not unread, f"in docs/configuration.md as uvicorn's, read by no code of uvicorn.config: {unread}"


def test_a_variable_has_one_row():
    names = [row.name for row in documented(DOC.read_text(encoding="utf-8"))]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []

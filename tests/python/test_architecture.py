"""The code's shape, checked: the package's imports form no circle and point one way between its
layers (placement <- engine parts <- optimizers <- the facade), the package's top holds at most 15
modules, no source file is over 500 lines and no function over 80 (docs/DESIGN.md), no C++ line
is wider than .clang-format's limit, and no C++ class in csrc/torch befriends another.
Static reads of the tree: no import of gemini_ext, well under a second."""

import ast
import collections
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gemini_ext"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_TOP_LEVEL_MODULES = 15
MAX_CPP_COLUMNS = 120  # .clang-format's ColumnLimit
# Each layer and the layers it must not import (a module counts as in a layer when its name is the
# layer's or starts with it and a dot).
FORBIDDEN_IMPORTS = {
    "gemini_ext.placement": ("gemini_ext._engine", "gemini_ext.optim", "gemini_ext.engine", "gemini_ext.checkpoint",
                             "gemini_ext.compat", "gemini_ext.integrations"),
    "gemini_ext._engine": ("gemini_ext.optim", "gemini_ext.engine", "gemini_ext.checkpoint", "gemini_ext.compat",
                           "gemini_ext.integrations"),
    "gemini_ext.optim": ("gemini_ext.engine", "gemini_ext.checkpoint", "gemini_ext.compat", "gemini_ext.integrations"),
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict:
    """Module -> modules of the package it imports (at module level or inside functions). The
    package's own __init__ is not an edge target: importing a submodule runs it first anyway."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = collections.defaultdict(set)
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                prefix = base[:len(base) - (node.level - 1)]
                targets = ([".".join(prefix + [node.module])] if node.module
                           else [".".join(prefix + [a.name]) for a in node.names])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != "gemini_ext")
    return graph


def _cycles(graph: dict) -> list:
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_package_imports_form_no_circle():
    graph = _import_graph()
    assert graph["gemini_ext.optim"], "the graph sees the package's imports"
    assert _cycles(graph) == []


def _in_layer(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def test_imports_point_one_way_between_the_rooms():
    graph = _import_graph()
    assert any(_in_layer(m, "gemini_ext.placement") for m in graph["gemini_ext._engine.build"]), "the layers are seen"
    wrong = [f"{importer} imports {imported}"
             for importer, imported_set in sorted(graph.items()) for imported in sorted(imported_set)
             for layer, forbidden in FORBIDDEN_IMPORTS.items()
             if _in_layer(importer, layer) and any(_in_layer(imported, f) for f in forbidden)]
    assert wrong == []


def test_the_package_top_holds_at_most_15_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert "engine.py" in top
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_class_in_csrc_torch_befriends_another():
    befriending = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "csrc" / "torch").rglob("*.[ch]*"))
                   for n, line in enumerate(p.read_text().split("\n"), 1) if re.search(r"\bfriend\s+class\b", line)]
    assert befriending == []


def _cpp_function_lengths(text: str):
    """(first line, length, signature) of each top-level function body in a C++ file: a line at
    brace depth 0 (namespaces aside) that opens a brace after a parameter list."""
    depth, start = 0, None
    for number, line in enumerate(text.split("\n"), 1):
        code = re.sub(r'"(\\.|[^"\\])*"', '""', re.sub(r"//.*", "", line))
        if re.match(r"^\s*namespace\b", code) or re.match(r"^}\s*//\s*namespace", line):
            continue
        if depth == 0 and "{" in code and ")" in code and re.match(r"^[A-Za-z]", code) and \
                not re.match(r"^(class|struct|enum|union)\b", code):
            start = (number, code.strip()[:70])
        depth += code.count("{") - code.count("}")
        if depth == 0 and start is not None and ("{" in code or "}" in code):
            yield start[0], number - start[0] + 1, start[1]
            start = None


def test_no_file_over_500_lines_and_no_function_over_80():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    sources = [p for ext in ("cpp", "h", "cu", "cuh") for p in (ROOT / "csrc").rglob(f"*.{ext}")]
    assert len(sources) > 40, "the C++ sources were found"
    for path in sorted(sources):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for first, length, signature in _cpp_function_lengths(text):
            if length > MAX_FUNCTION_LINES:
                too_long.append(f"{path.relative_to(ROOT)}:{first} {signature}: {length} lines")
    assert too_long == []


# A source path written in the tree: from the repository's root, or from csrc/ or gemini_ext/
# ("torch/optim/hybrid_optimizer.h", "placement/placer.py"). Patterns (core/static_placement.*,
# manager_<part>.cpp) are not paths and are not matched.
_WRITTEN_PATH = re.compile(r"(?<![\w/.<*-])((?:csrc|gemini_ext|tests|bench|docs|scripts|examples|core|torch|cuda|"
                           r"bindings|placement|_engine|optim|integrations)/[\w./-]*\w\.(?:py|h|cpp|cu|md|sh))\b")


def test_every_source_path_written_in_the_tree_exists():
    """Comments, docstrings and docs name files by path; a renamed file leaves them pointing
    nowhere. The dated archive of old benchmark notes is history and is not read."""
    files = [p for top in ("gemini_ext", "csrc", "tests", "bench", "scripts", "examples", "docs")
             for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".h", ".cpp", ".cu", ".md", ".sh")
             and "archive" not in p.parts] + [ROOT / "README.md"]
    stale = sorted({(str(f.relative_to(ROOT)), path) for f in files for path in _WRITTEN_PATH.findall(f.read_text())
                    if not any((base / path).exists() for base in (ROOT, ROOT / "csrc", ROOT / "gemini_ext",
                                                                   f.parent))})
    assert not stale, stale


def test_no_cpp_line_is_wider_than_the_clang_format_limit():
    config = (ROOT / ".clang-format").read_text()
    assert f"ColumnLimit: {MAX_CPP_COLUMNS}" in config
    sources = [p for folder in ("csrc", "tests/cpp", "bench/cpp") for p in sorted((ROOT / folder).rglob("*"))
               if p.suffix in (".h", ".cpp", ".cu", ".inc")]
    assert len(sources) > 50
    wide = [f"{p.relative_to(ROOT)}:{n}" for p in sources
            for n, line in enumerate(p.read_text().split("\n"), 1) if len(line) > MAX_CPP_COLUMNS]
    assert wide == [], "wider than .clang-format's limit (run clang-format on them): " + ", ".join(wide[:10])


def test_no_python_line_is_wider_than_the_ruff_limit():
    config = (ROOT / "pyproject.toml").read_text()
    assert f"line-length = {MAX_CPP_COLUMNS}" in config  # one width for both languages
    sources = [p for folder in ("gemini_ext", "tests", "bench", "examples", "scripts") for p in
               sorted((ROOT / folder).rglob("*.py"))] + [ROOT / "setup.py"]
    assert len(sources) > 100
    wide = [f"{p.relative_to(ROOT)}:{n}" for p in sources
            for n, line in enumerate(p.read_text().split("\n"), 1) if len(line) > MAX_CPP_COLUMNS]
    assert wide == [], "wider than pyproject.toml's line-length: " + ", ".join(wide[:10])


def test_ruff_check_passes():
    """pyproject.toml's [tool.ruff.lint] rules over the whole tree (ruff comes with the test extra)."""
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def test_every_error_that_says_it_is_a_bug_is_an_internal_error():
    """README: an internal error is gx.InternalError (which callers can catch as such), never another
    exception class that only says so in its message."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            text = " ".join(c.value for c in ast.walk(node.exc)
                            if isinstance(c, ast.Constant) and isinstance(c.value, str))
            called = ast.unparse(node.exc.func)
            if ("internal error" in text or "is a bug" in text) and not called.endswith("InternalError"):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} raises {called}")
    assert wrong == []


def test_every_note_is_cited_where_its_rule_applies():
    """A `[Note: X]` block says a rule once; the code it governs says "see [Note: X]", on one line
    (FSDP2's convention): a note that nothing cites is a rule nobody is pointed to."""
    sources = [p for folder in ("gemini_ext", "csrc") for p in sorted((ROOT / folder).rglob("*"))
               if p.suffix in (".py", ".h", ".cpp", ".inc", ".cu")]
    defined, cited = {}, set()
    for path in sources:
        for match in re.finditer(r"(see )?\[Note: ([^\]]+)\]", path.read_text()):
            if match.group(1):
                cited.add(match.group(2))
            else:
                defined.setdefault(match.group(2), str(path.relative_to(ROOT)))
    assert len(defined) > 30
    assert {n: p for n, p in defined.items() if n not in cited} == {}
    assert cited <= set(defined), f"cited but written nowhere: {sorted(cited - set(defined))}"

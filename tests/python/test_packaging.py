"""The package as a user installs it: the source distribution holds everything the build compiles
or includes, an isolated build is refused before any compiler runs, a torch other than the one
the extension was built for is named at import, one version string, the `gemini-ext` command,
and the `test` extra installed by the test command."""

import ast
import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile

import torch
from packaging.requirements import Requirement

import gemini_ext as gx
from conftest import REPO, run_python

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _setup_source_patterns() -> list:
    """CPU_SOURCES and CUDA_SOURCES as setup.py declares them (read, not executed)."""
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("CPU_SOURCES", "CUDA_SOURCES"):
            found[node.targets[0].id] = ast.literal_eval(node.value)
    assert set(found) == {"CPU_SOURCES", "CUDA_SOURCES"}, f"setup.py no longer declares both source lists: {found}"
    return [p for patterns in found.values() for p in patterns]


def _build_inputs() -> set:
    """Every file under the repository that the extension's build compiles or includes, CPU and
    CUDA alike: the sources setup.py lists and the transitive closure of their quoted includes
    (resolved as the compiler does: beside the including file, then from csrc/)."""
    csrc = os.path.join(REPO, "csrc")
    todo = [os.path.relpath(p, REPO) for pattern in _setup_source_patterns()
            for p in glob.glob(os.path.join(csrc, pattern))]
    assert any(p.endswith(".cu") for p in todo) and any(p.startswith("csrc/bindings") for p in todo), todo
    seen = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in INCLUDE.findall(open(os.path.join(REPO, path)).read()):
            for base in (os.path.dirname(os.path.join(REPO, path)), csrc):
                candidate = os.path.normpath(os.path.join(base, name))
                if os.path.isfile(candidate):
                    todo.append(os.path.relpath(candidate, REPO))
                    break
    return seen


def test_sdist_holds_every_file_the_build_compiles_or_includes(tmp_path):
    # A fresh egg-info folder: setuptools would otherwise start from the file list of an earlier build.
    (tmp_path / "egg").mkdir()
    out = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path / "egg"),
                          "sdist", "--dist-dir", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "GEMINI_EXT_CUDA": "0"})
    assert out.returncode == 0, out.stderr
    (archive,) = glob.glob(str(tmp_path / "gemini_ext-*.tar.gz"))
    assert os.path.basename(archive) == f"gemini_ext-{gx.__version__}.tar.gz"
    with tarfile.open(archive) as tar:
        members = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    inputs = _build_inputs()
    headers = {p for p in inputs if p.endswith((".h", ".inc"))}
    assert len(headers) > 40 and any(p.endswith(".inc") for p in headers), sorted(headers)
    missing = sorted(inputs - members)
    assert missing == [], f"the sdist lacks {len(missing)} of the build's {len(inputs)} files: {missing}"
    modules = {os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "gemini_ext", "**", "*.py"),
                                                            recursive=True)} - {"gemini_ext/_native/built_for.py"}
    assert sorted(modules - members) == []
    assert {"setup.py", "pyproject.toml", "README.md", "MANIFEST.in"} <= members
    built = sorted(m for m in members if m.endswith((".so", ".o", ".pyc")) or m.endswith("_native/built_for.py"))
    assert built == [], f"the sdist carries build outputs: {built}"


def test_an_isolated_build_is_refused_naming_no_build_isolation():
    """pip's build isolation runs setup.py where the installed torch is not importable; the
    refusal comes before any compiler runs (torch is hidden here as isolation hides it)."""
    hide_torch = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', 'egg_info']; "
                  "runpy.run_path('setup.py', run_name='__main__')")
    out = run_python("-c", hide_torch)
    assert out.returncode != 0
    assert "pip install --no-build-isolation ." in out.stderr and "isolat" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_import_under_another_torch_names_both_versions():
    out = run_python("-c", "import torch; torch.__version__ = '0.0.1+other'; import gemini_ext")
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: gemini_ext was built against torch "), message
    assert f"torch {torch.__version__}" in message and "torch 0.0.1+other is installed" in message, message
    assert "Rebuild" in message and "--no-build-isolation" in message, message


def test_one_version_string():
    assert importlib.metadata.version("gemini_ext") == gx.__version__
    out = run_python("-m", "gemini_ext", "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"gemini_ext {gx.__version__}", out.stderr


def test_console_script_runs_info():
    script = shutil.which("gemini-ext", path=os.path.dirname(sys.executable))
    assert script is not None, f"no gemini-ext script beside {sys.executable}: the package is not installed"
    out = subprocess.run([script, "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "gemini_ext build" in out.stdout and torch.__version__ in out.stdout, out.stdout
    out = subprocess.run([script, "export", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: gemini-ext export"), out.stdout + out.stderr


def _requirements(extra: str, seen=None) -> list:
    """The requirements gemini_ext[extra] brings, with the extras it names expanded."""
    seen = set() if seen is None else seen
    seen.add(extra)
    found = []
    for text in importlib.metadata.requires("gemini_ext") or []:
        req = Requirement(text)
        if req.marker is None or not req.marker.evaluate({"extra": extra}):
            continue
        if req.name.replace("-", "_") == "gemini_ext":
            for inner in sorted(req.extras - seen):
                found += _requirements(inner, seen)
        else:
            found.append(req)
    return found


def test_the_test_extra_is_installed_at_allowed_versions():
    """The test command installs the package's `test` extra; a package the suite imports that is
    missing or too old fails here instead of skipping tests elsewhere."""
    reqs = _requirements("test")
    names = {r.name for r in reqs}
    assert {"pytest", "transformers", "accelerate", "lightning", "safetensors", "matplotlib"} <= names, names
    problems = []
    for req in reqs:
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req.name} is not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name} {version} does not satisfy {req}")
    assert problems == [], "; ".join(problems) + " (run ./scripts/test.sh, which installs the test extra)"


def test_the_install_scripts_read_the_same_requirements_as_pip():
    """scripts/extra_requirements.py (the list setup_env.sh installs while the extension
    compiles) expands the `test` extra as pip does from the package's metadata."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("extra_requirements",
                                                  os.path.join(REPO, "scripts", "extra_requirements.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = [Requirement(t) for t in importlib.metadata.requires("gemini_ext") or [] if "extra ==" not in t]
    expected = {str(Requirement(str(r).split(";")[0])) for r in base + _requirements("test")}
    assert {str(Requirement(t)) for t in module.requirements(["test"])} == expected

# Sourced by scripts/train.sh and scripts/test.sh: installs what is missing, reuses what is there.
#   torch        pip install torch==2.13.0 when `import torch` fails (a machine with a CUDA torch
#                keeps it)
#   GoogleTest   Debian's libgtest-dev (tests only), unless already installed or its sources are
#                in $GX_GTEST_SOURCE, .deps/googletest or /usr/src/googletest
#   gemini_ext   pip install --no-build-isolation -e ".[EXTRA]" when the extension is missing, its
#                sources changed since the last build or the extra was not installed with it (a
#                stamp in build/ records what was built and installed); the extras of pyproject.toml
#                are the one list of Python packages (tqdm comes with the package itself). With an
#                extra, the compile and the extra's downloads run side by side (the package with
#                --no-deps, the requirements scripts/extra_requirements.py reads beside it)
# Honours PYTHON (default python3), MAX_JOBS (default: all cores), GX_PIP_NO_COMPILE=1 (pip
# installs without byte-compiling every module it installs: for a fresh environment whose
# interpreters write the bytecode of what they import, scripts/test.sh's CI path) and
# GX_WARM_IMPORTS (Python run once the extra's packages are in, beside the compile: the imports
# whose bytecode every later process would otherwise write at once).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO="sudo"

log() { echo "[setup] $*" >&2; }

pip_install() {  # pip install -q, without byte-compiling under GX_PIP_NO_COMPILE=1
  local flags=()
  [ "${GX_PIP_NO_COMPILE:-0}" = 1 ] && flags=(--no-compile)
  "$PYTHON" -m pip install -q "${flags[@]}" "$@"
}

has_python_module() {  # module: installed (found, not imported: importing lightning alone takes seconds)
  "$PYTHON" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$1') else 1)" 2>/dev/null
}

ensure_torch() {
  if ! has_python_module torch; then
    log "torch is not importable: installing torch==2.13.0"
    pip_install "torch==2.13.0" numpy  # numpy: torch warns at import without it
  fi
}

apt_install() {
  command -v apt-get >/dev/null || { log "apt-get not available to install $*"; return 1; }
  $SUDO apt-get install -y -q "$@" >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q "$@" >/dev/null; }
}

gtest_source_dir() {
  for d in "${GX_GTEST_SOURCE:-}" "$REPO/.deps/googletest" /usr/src/googletest; do
    [ -n "$d" ] && [ -f "$d/CMakeLists.txt" ] && { echo "$d"; return 0; }
  done
  return 1
}

ensure_cpp_toolchain() {
  command -v cmake >/dev/null || apt_install cmake
  if [ ! -f /usr/include/gtest/gtest.h ] && ! gtest_source_dir >/dev/null; then
    log "installing GoogleTest (libgtest-dev)"
    apt_install libgtest-dev || { log "GoogleTest missing: install libgtest-dev, set GX_GTEST_SOURCE or copy its sources to .deps/googletest"; return 1; }
  fi
}

source_hash() {
  (cd "$REPO" && find csrc setup.py pyproject.toml MANIFEST.in -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.inc' -o -name '*.cu' -o -name '*.py' -o -name '*.toml' -o -name MANIFEST.in \) -print0 \
    | sort -z | xargs -0 sha256sum; "$PYTHON" -c "import sys, torch; print(sys.version, torch.__version__)"; echo "${GEMINI_EXT_CUDA:-} ${GEMINI_EXT_UNITY:-}") | sha256sum | cut -d' ' -f1
}

ensure_build_tools() {  # what `pip install --no-build-isolation` needs from the environment
  "$PYTHON" - <<'PY' 2>/dev/null || { log "installing setuptools>=64, wheel"; pip_install "setuptools>=64" wheel; }
import setuptools, wheel
assert int(setuptools.__version__.split(".")[0]) >= 64
PY
}

package_index_reachable() {  # whether pip can fetch from its configured index (a short probe)
  local probe rc=0
  probe="$(mktemp -d)"
  "$PYTHON" -m pip download -q --no-deps --retries 0 --timeout 5 -d "$probe" pip >/dev/null 2>&1 || rc=1
  rm -rf "$probe"
  return "$rc"
}

build_action() {  # want_hash stamp_hash stamp_extras wanted_extras importable(1/0) -> keep | extras | build
  # keep: the build matches the sources and holds the extras asked for; extras: it matches, only the
  # extra's packages are missing (installed without compiling again); build: anything else.
  local want="$1" have="$2" had="$3" extras="$4" importable="$5"
  if [ "$want" != "$have" ] || [ "$importable" != 1 ]; then
    echo build
  elif [ -z "$extras" ] || [[ ",$had," == *",$extras,"* ]]; then
    echo keep
  else
    echo extras
  fi
}

ensure_extension() {  # [extra]: the editable install of gemini_ext, with that extra's packages
  ensure_build_tools
  local stamp="$REPO/build/.gemini_ext_stamp" want extras="${1:-}" spec="."
  want="$(source_hash)"
  if [ -f "$stamp" ] && [ "$(head -n1 "$stamp")" = "$want" ]; then
    # The same sources: keep the build, and the extras already installed with it.
    local had importable=0 action
    had="$(sed -n 2p "$stamp")"
    (cd /tmp && "$PYTHON" -c "import gemini_ext._C, os, sys; sys.exit(0 if os.path.realpath(gemini_ext.__file__).startswith(os.path.realpath('$REPO')) else 1)") 2>/dev/null && importable=1
    action="$(build_action "$want" "$(head -n1 "$stamp")" "$had" "$extras" "$importable")"
    [ "$action" = keep ] && return 0
    if [ "$action" = extras ]; then
      # Only the extra is missing: its packages, without building the extension again.
      if package_index_reachable; then
        local reqs
        mapfile -t reqs < <("$PYTHON" "$REPO/scripts/extra_requirements.py" "$extras") || return 1
        log "installing gemini_ext's [$extras] packages (the build is current)"
        pip_install "${reqs[@]}" || return 1
        printf '%s\n%s\n' "$want" "${had:+$had,}$extras" > "$stamp"
        return 0
      fi
    fi
    [ -n "$had" ] && extras="${extras:+$extras,}$had"
  fi
  [ -n "$extras" ] && spec=".[$extras]"
  log "building and installing gemini_ext$([ -n "$extras" ] && echo " with [$extras]") (MAX_JOBS=$MAX_JOBS)"
  if [ -n "$extras" ]; then
    # The extension compiles while pip downloads and installs the extras' packages (the compile
    # needs only torch and setuptools, which are in place): the package without dependencies in
    # the background, the requirements pyproject.toml lists for the extras beside it.
    local build_log="$REPO/build/pip-install-gemini_ext.log" build_pid reqs
    mkdir -p "$REPO/build"
    mapfile -t reqs < <("$PYTHON" "$REPO/scripts/extra_requirements.py" "$extras") || return 1
    (cd "$REPO" && pip_install --no-build-isolation --no-deps -e .) > "$build_log" 2>&1 &
    build_pid=$!
    if package_index_reachable; then
      if ! pip_install "${reqs[@]}"; then
        kill "$build_pid" 2>/dev/null || true
        return 1
      fi
      if [ -n "${GX_WARM_IMPORTS:-}" ]; then
        "$PYTHON" -c "$GX_WARM_IMPORTS" >/dev/null 2>&1 || log "GX_WARM_IMPORTS failed (the tests import for themselves)"
      fi
    else
      # No package index (a GPU machine without network; probed first, since pip's retries against
      # an unreachable index take minutes): keep what is installed, say what is missing; the tests
      # that need a missing package skip naming it. The stamp does not record the extra, so a later
      # run with an index installs it.
      local missing=()
      for req in "${reqs[@]}"; do
        "$PYTHON" -m pip install -q --no-index --no-deps "$req" >/dev/null 2>&1 || missing+=("$req")
      done
      log "no package index reachable: not installed: ${missing[*]} (the tests that import them skip)"
      extras=""
    fi
    if ! wait "$build_pid"; then
      cat "$build_log" >&2
      return 1
    fi
  else
    (cd "$REPO" && pip_install --no-build-isolation -e "$spec") || return 1
  fi
  mkdir -p "$REPO/build"
  printf '%s\n%s\n' "$want" "$extras" > "$stamp"
}

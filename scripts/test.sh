#!/usr/bin/env bash
# The whole test suite: the C++ core's GoogleTest suite (and the cuda backend's, which skips
# without a GPU), a compile check of the CUDA-only torch-layer code when CUDA headers exist but
# the extension is CPU-only, then pytest. Installs whatever is missing first. Extra arguments go
# to pytest (e.g. -m cuda).
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
ensure_torch
ensure_python_module tqdm tqdm
ensure_python_module pytest pytest
ensure_python_module matplotlib matplotlib
ensure_python_module transformers "transformers>=4.45"   # real models from small configs (no weights downloaded)
ensure_python_module safetensors safetensors
ensure_cpp_toolchain
ensure_extension
cd "$REPO"

echo "== C++: configure and build the core tests"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
src="$(gtest_source_dir || true)"
cmake -S csrc -B build/cpp "${generator[@]}" ${src:+-DGX_GTEST_SOURCE="$src"} >/dev/null
cmake --build build/cpp -j "$MAX_JOBS"
echo "== C++: run"
./build/cpp/gx_core_tests --gtest_brief=1
if [ -x build/cpp/gx_cuda_tests ]; then
  ./build/cpp/gx_cuda_tests --gtest_brief=1
fi

if [ "$("$PYTHON" -c 'import gemini_ext; print(gemini_ext._C.build_info()["cuda"])')" = "False" ]; then
  echo "== CUDA sources of the torch layer: compile-only check"
  "$PYTHON" scripts/cuda_compile_check.py
fi

echo "== pytest"
exec "$PYTHON" -m pytest -q -ra "$@"

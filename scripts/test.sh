#!/usr/bin/env bash
# The whole test suite: the C++ core's GoogleTest suite (and the cuda backend's, which skips
# without a GPU), a compile check of the CUDA-only torch-layer code when CUDA headers exist but
# the extension is CPU-only, then pytest. Installs whatever is missing first (the package itself,
# editable, with its `test` extra). Extra arguments go to pytest (e.g. -m cuda).
#
# With a CPU build of torch and no extra arguments (CI) the stages share the cores: the C++ stage
# starts in the background before torch and the package are installed (it needs neither), and
# pytest runs as four processes (most tests wait on child processes, so one pytest keeps about
# one core busy). Each background stage's output is printed when it ends. With a CUDA torch the
# stages run one after another, since GPU tests of two processes would compete for the device.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$REPO"

cpp_stage() {  # the GoogleTest suites: needs neither torch nor the extension
  local stage_started=$SECONDS
  echo "== C++: configure and build the core tests"
  local generator=() src
  command -v ninja >/dev/null && generator=(-G Ninja)
  src="$(gtest_source_dir || true)"
  # -O0 without debug information: the suite needs neither (a debugger session configures its
  # own build directory); its build is 42 s of CPU against 54 s at -O1, its run 5 s against 3. It
  # is a unity build (csrc/CMakeLists.txt): about half the CPU of a build file by file.
  cmake -S csrc -B build/cpp "${generator[@]}" ${src:+-DGX_GTEST_SOURCE="$src"} \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O0 -g0 -DNDEBUG" >/dev/null
  cmake --build build/cpp -j "$MAX_JOBS"
  echo "== C++: run"
  ./build/cpp/gx_core_tests --gtest_brief=1
  if [ -x build/cpp/gx_cuda_tests ]; then
    ./build/cpp/gx_cuda_tests --gtest_brief=1
  fi
  echo "[C++ stage took $((SECONDS - stage_started)) s]"
}

cuda_check_stage() {  # CPU-only extensions: the torch layer's CUDA paths compile (needs torch)
  echo "== CUDA sources of the torch layer: compile-only check"
  "$PYTHON" scripts/cuda_compile_check.py
}

# Parallel (CI): no pytest arguments and a CPU torch, or none yet (ensure_torch installs the CPU
# build). Otherwise one stage after another.
if [ $# -gt 0 ] || { has_python_module torch && [ "$("$PYTHON" -c 'import torch; print(torch.version.cuda is None)')" = "False" ]; }; then
  have_cpp=1
  ensure_cpp_toolchain || have_cpp=0  # no GoogleTest and none to fetch: the other stages still run
  ensure_torch
  ensure_extension test   # pyproject.toml's `test` extra: pytest and every integration's packages
  if [ "$have_cpp" = 1 ]; then
    cpp_stage
  else
    echo "== C++ stage SKIPPED: GoogleTest is not installed and could not be fetched (see above)"
  fi
  if [ "$("$PYTHON" -c 'import gemini_ext; print(gemini_ext._C.build_info()["cuda"])')" = "False" ]; then
    cuda_check_stage
  fi
  echo "== pytest"
  exec "$PYTHON" -m pytest -q -ra "$@"
fi

# The stages share the cores: torch's intra-op threads in each test process would only add
# context switches (the CPU optimizer kernels size their own thread pool from the hardware).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# pip byte-compiles every module it installs: about 45 s of CPU before the first test, torch's
# share before the compile can start, for thousands of modules no test imports. Here the
# interpreters write the bytecode of what they import instead, and one import of what every test
# process loads runs beside the compile, so that the four pytest processes do not each compile it.
unset PYTHONDONTWRITEBYTECODE
export GX_PIP_NO_COMPILE=1
export GX_WARM_IMPORTS="import torch, torch.distributed.checkpoint, torch._dynamo, numpy, safetensors.torch, pytest
import transformers, accelerate, peft, lightning, trl
from transformers import Trainer, TrainingArguments, LlamaForCausalLM, MixtralForCausalLM"
logs=build/test-logs
rm -rf "$logs" build/test-tmp
mkdir -p "$logs" build/test-tmp  # pytest creates --basetemp itself, not its parents
started=$SECONDS
# The C++ build fills the core that pip leaves idle while it installs torch and the test extra.
(ensure_cpp_toolchain && cpp_stage) > "$logs/cpp.log" 2>&1 &
cpp_pid=$!
if ! { ensure_torch && ensure_extension test; }; then  # beside the C++ stage
  kill "$cpp_pid" 2>/dev/null || true
  echo "== FAILED: torch, gemini_ext or its test extra did not install (see above)"
  exit 1
fi
echo "== package installed and built [after $((SECONDS - started)) s]"
(cuda_check_stage) > "$logs/cuda-check.log" 2>&1 &
cuda_check_pid=$!
# Three pytest processes beside the main one, so that the waits of one (child interpreters,
# gloo ranks, sleeping copies) are another's compute; each group takes about a quarter of the
# suite's time (the benchmark smoke tests, which start child interpreters, are split in two by
# node id, and the main process runs every file no group names). One argument per line.
smoke=tests/python/test_bench_smoke.py
bench_big=("$smoke::test_scaling_bench_smoke" "$smoke::test_offload_bench_smoke" "$smoke::test_capacity_bench_smoke"
           "$smoke::test_trl_grpo_bench_times_the_loops_phases_beside_the_floor")
groups=(bench-big bench-rest multiprocess)
declare -A group_args=(
  [bench-big]="$(printf '%s\n' "${bench_big[@]}")
tests/python/test_integration_lightning.py
tests/python/test_hostile.py"
  [bench-rest]="$smoke
$(printf -- '--deselect=%s\n' "${bench_big[@]}")
tests/python/test_integration_transformers.py"
  [multiprocess]="tests/python/test_distributed.py
tests/python/test_sim_delays.py
tests/python/test_example.py
tests/python/test_integration_accelerate.py
tests/python/test_checkpoint.py
tests/python/test_fork.py"
)
declare -A pids=()
ignore=()
for name in "${groups[@]}"; do
  mapfile -t args <<< "${group_args[$name]}"
  for arg in "${args[@]}"; do
    [[ "$arg" == tests/* ]] && ignore+=("--ignore=${arg%%::*}")
  done
  "$PYTHON" -m pytest -q -ra -p no:cacheprovider --durations=8 --basetemp "build/test-tmp/$name" "${args[@]}" \
    > "$logs/pytest-$name.log" 2>&1 &
  pids[$name]=$!
done
echo "== pytest (the rest; C++ and ${groups[*]} run beside it, logs in $logs/)"
rc=0
"$PYTHON" -m pytest -q -ra -p no:cacheprovider --durations=8 --basetemp build/test-tmp/main "${ignore[@]}" || rc=$?
echo "   [pytest done after $((SECONDS - started)) s]"
for name in "${groups[@]}"; do
  wait "${pids[$name]}" || rc=$?
  echo "== pytest $name: $(echo ${group_args[$name]}) [done after $((SECONDS - started)) s]"
  cat "$logs/pytest-$name.log"
done
wait "$cpp_pid" || rc=$?
echo "== C++ stage [done after $((SECONDS - started)) s]"
cat "$logs/cpp.log"
wait "$cuda_check_pid" || rc=$?
cat "$logs/cuda-check.log"
[ "$rc" -eq 0 ] && echo "== all stages passed" || echo "== FAILED: see the output above"
exit "$rc"

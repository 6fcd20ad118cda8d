"""The benchmarks' one entry point (registry: bench/presets.py).

    python -m bench list                  # the presets, what each reproduces
    python -m bench show NAME             # the command a preset runs
    python -m bench NAME [ARGS...]        # runs it and writes bench/records/NAME.json; ARGS go to its runner
                                          # (--out /tmp/x, --timeout 200; others change the preset: no record;
                                          # --records DIR: the record goes to DIR instead)
    python -m bench tables [--check]      # README's and BENCHMARKS' tables from bench/records/ (--check: differ?)
    python -m bench records               # each record: machine, date, whether the engine changed since
    python -m bench systems               # the systems and models the runners know
    python -m bench run RUNNER [ARGS...]  # a runner with arguments of your own (its --help lists them)

Every runner starts each system in a fresh process and writes markdown and JSON rows beside --out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import presets  # noqa: E402

REPO = os.path.dirname(HERE)


def _run(script_args: list[str]) -> int:
    return subprocess.call([sys.executable, *script_args], cwd=REPO)


def _systems() -> str:
    import hf_models
    import offload
    lines = ["transformers' causal LMs (hf_models, hf_map: --systems):"]
    lines += [f"  {name:30s} {hf_models.LABELS.get(name, '')}" for name in hf_models.SYSTEMS]
    from hf_train import MODELS
    lines += ["  models (--models): " + ", ".join(sorted(MODELS)), "the project's GPT (offload: --only):"]
    lines += [f"  {name}" for name in offload.systems(None)]
    from gemini_ext.models import GPT_PRESETS
    lines += ["  models (--preset): " + ", ".join(GPT_PRESETS)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    what, rest = argv[0], argv[1:]
    if what == "list":
        for name, p in presets.PRESETS.items():
            print(f"{name:32s} {p.reproduces}")
        return 0
    if what == "tables":
        import tables
        return tables.main(rest)
    if what == "records":
        import records
        return records.main(rest)
    if what == "systems":
        print(_systems())
        return 0
    if what == "show":
        if not rest or rest[0] not in presets.PRESETS:
            print(f"python -m bench show: name one of {list(presets.PRESETS)}", file=sys.stderr)
            return 2
        print("python3 " + " ".join(presets.PRESETS[rest[0]].command()))
        return 0
    if what == "run":
        if not rest or rest[0] not in presets.RUNNERS:
            print(f"python -m bench run: name one of the runners {list(presets.RUNNERS)}", file=sys.stderr)
            return 2
        return _run([f"bench/{presets.RUNNERS[rest[0]][0]}", *rest[1:]])
    if what not in presets.PRESETS:
        print(f"python -m bench: no preset {what!r}; `python -m bench list` names them", file=sys.stderr)
        return 2
    if presets.PRESETS[what].needs_gpu and not _gpu_here():
        print(f"python -m bench {what}: this preset measures a GPU, and torch sees none here "
              "(torch.cuda.is_available() is False). `python -m bench smoke` runs the map's rows on sim; "
              "`python -m bench list` says what each preset reproduces.", file=sys.stderr)
        return 2
    return _run_preset(what, rest)


# Arguments that leave the preset's figures as they are: where its files go, how long a row may run.
_RECORD_NEUTRAL = ("--out", "--json-out", "--timeout")


def _run_preset(name: str, rest: list[str]) -> int:
    """Runs the preset and, where its runner's rows can be recorded (presets.RECORDED_BY) and `rest`
    changes nothing the figures depend on, writes the record of what it measured: to bench/records/
    for a GPU's preset, or to the folder `--records DIR` names (for any preset; not passed on)."""
    import records

    preset = presets.PRESETS[name]
    directory = records.DIRECTORY if preset.needs_gpu else None
    if "--records" in rest:
        i = rest.index("--records")
        if i + 1 >= len(rest):
            print("python -m bench: --records needs a folder", file=sys.stderr)
            return 2
        directory, rest = rest[i + 1], rest[:i] + rest[i + 2:]
    output = presets.RECORDED_BY.get(preset.runner)
    changes = [a for a in rest if a.startswith("--") and a.split("=")[0] not in _RECORD_NEUTRAL]
    if output is None or directory is None or changes:
        if output is not None and changes:
            print(f"python -m bench {name}: no record ({' '.join(changes)} changes the preset)", file=sys.stderr)
        return _run([*preset.command(), *rest])
    if output in rest:
        at = rest[rest.index(output) + 1]
    else:
        at = os.path.join(tempfile.mkdtemp(prefix="gx-bench-"), "run" + (".json" if output == "--json-out" else ""))
        rest = [*rest, output, at]
    rc = _run([*preset.command(), *rest])
    path = at + ".json" if output == "--out" else at
    if rc != 0 or not os.path.exists(path):
        print(f"python -m bench {name}: the runner ended with status {rc}; no record written", file=sys.stderr)
        return rc or 1
    with open(path) as f:
        result = json.load(f)
    record = records.make(name, preset.command(), preset.reproduces, records.rows_of(preset.runner, result),
                          presets.peak_tflops(preset))
    print(f"python -m bench {name}: record written to {records.save(record, directory)}")
    return 0


def _gpu_here() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())

"""Prints, one per line, the requirements of gemini_ext with the given extras, read from
pyproject.toml (the one list of them): the base dependencies, each extra's list, and the extras
an extra names through the package itself (`gemini_ext[a,b]`), expanded. Used by
scripts/setup_env.sh to install an extra's packages while the extension compiles.

    python scripts/extra_requirements.py test
"""

import os
import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: pip carries the same parser
    from pip._vendor import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELF = re.compile(r"^gemini[-_]ext\[(?P<extras>[^\]]*)\]$", re.IGNORECASE)


def requirements(extras: list[str]) -> list[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    out, seen, todo = list(project.get("dependencies", [])), set(), list(extras)
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            sys.exit(f"extra_requirements.py: pyproject.toml has no extra {extra!r}; it has {sorted(optional)}")
        seen.add(extra)
        for req in optional[extra]:
            m = SELF.match(req.replace(" ", ""))
            if m:
                todo += [e for e in m["extras"].split(",") if e]
            elif req not in out:
                out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(requirements([e for arg in sys.argv[1:] for e in arg.split(",") if e])))

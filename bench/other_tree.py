"""The gateway of another commit, for an A/B in one run: ``worktree(REV)`` checks REV out
into a temporary git worktree, and ``python -m bench.other_tree TREE ARGS...`` runs
``python -m gateway ARGS...`` from that tree's sources with this environment's packages.

The project is installed editable here, and its import finder would find this tree's
``gateway`` before any path entry: it is taken off ``sys.meta_path`` first.
"""

from __future__ import annotations

import atexit
import functools
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def worktree(rev: str) -> Path:
    """A checkout of ``rev`` (removed when this process exits)."""
    folder = Path(tempfile.mkdtemp(prefix="bench-tree-")) / rev
    git = ["git", "-C", str(ROOT)]
    subprocess.run(
        [*git, "worktree", "add", "--detach", str(folder), rev], check=True, capture_output=True
    )

    def remove() -> None:
        subprocess.run(
            [*git, "worktree", "remove", "--force", str(folder)], check=False, capture_output=True
        )
        shutil.rmtree(folder.parent, ignore_errors=True)

    atexit.register(remove)
    return folder


def gateway_argv(rev: str, argv: list[str]) -> list[str]:
    """``argv`` (a ``python -m gateway ...`` command line) run from ``rev``'s tree."""
    assert argv[1:3] == ["-m", "gateway"], argv
    return [argv[0], "-m", "bench.other_tree", str(worktree(rev)), *argv[3:]]


def main() -> None:
    tree = sys.argv.pop(1)
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in repr(f)]
    for name in [m for m in sys.modules if m.split(".")[0] in ("gateway", "sessions")]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    runpy.run_module("gateway", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""recflow's layers import downward only, and no package has an import cycle.

The contracts live in pyproject.toml (`[tool.importlinter]`); import-linter builds
the import graph from the source, imports inside functions included, so a cycle
cannot hide in a function body. It runs in its own process: it reconfigures logging.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_layers_import_downward_only_with_no_cycles():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout

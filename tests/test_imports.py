"""What importing a package loads, each in a fresh interpreter: a process that does not need a heavy
library never pays for it (the launcher's own check is in tests/launcher/test_cli.py)."""

import subprocess
import sys


def test_importing_kvcore_loads_neither_torch_nor_scikit_learn():
    code = "import sys, kvcore, kvcore.trainer, kvcore.dataparallel; print(sorted({'torch', 'sklearn'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"

"""What importing a package loads, each in a fresh interpreter: a process that does not need a heavy
library never pays for it (the launcher's own check is in tests/launcher/test_cli.py)."""

import subprocess
import sys


def test_importing_kvcore_loads_neither_torch_nor_scikit_learn():
    code = "import sys, kvcore, kvcore.trainer, kvcore.dataparallel; print(sorted({'torch', 'sklearn'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_the_contract_loads_neither_zmq_nor_numpy_and_the_runtime_never_loads_the_launcher():
    # pscontract is what the launcher and the runtime share; the launcher stays free of the runtime's
    # libraries and the runtime (every psnode module, the test kits aside) of the launcher.
    code = "\n".join([
        "import sys, pkgutil, importlib, pscontract",
        "print(sorted({'zmq', 'numpy'} & set(sys.modules)))",
        "import psnode",
        "for info in pkgutil.walk_packages(psnode.__path__, 'psnode.'):",
        "    if not info.name.endswith('__main__'):",
        "        importlib.import_module(info.name)",
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('launcher', 'testkit', 'benchmarks')))",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "[]"]

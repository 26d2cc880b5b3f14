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


def test_what_runs_on_the_nodes_loads_the_standard_library_only():
    # launcher/on_node/ is started on nodes whose Python has only pslaunch's own files (the rank shim
    # under srun, the SGE job, the watchdog, the Ray actor): each of its modules, imported alone in a
    # fresh interpreter, loads nothing beyond the standard library, pscontract and on_node itself
    import pkgutil

    import launcher.on_node

    names = [info.name for info in pkgutil.iter_modules(launcher.on_node.__path__, "launcher.on_node.")]
    assert len(names) >= 6, names
    code = "\n".join([
        "import sys, importlib",
        "before = set(sys.modules)",
        "importlib.import_module(sys.argv[1])",
        "allowed = lambda m: (m.split('.')[0] in sys.stdlib_module_names or m.split('.')[0] == 'pscontract'",
        "                     or m in ('launcher', 'launcher.on_node') or m.startswith('launcher.on_node.'))",
        "print(sorted(m for m in set(sys.modules) - before if not allowed(m)))",
    ])
    for name in names:
        out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.strip() == "[]", f"{name} loads {out.stdout.strip()}"


def test_kvcore_names_each_of_its_modules_public_or_internal():
    # a module added to kvcore says whether training code may import it (kvcore/__init__.py)
    import pkgutil

    import kvcore

    public, internal = set(kvcore.PUBLIC_MODULES), set(kvcore.INTERNAL_MODULES)
    assert not public & internal, public & internal
    found = {info.name for info in pkgutil.iter_modules(kvcore.__path__)}
    assert found == public | internal, (found - public - internal, (public | internal) - found)
    for name in kvcore.__all__:
        assert hasattr(kvcore, name), name

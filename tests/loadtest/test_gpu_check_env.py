"""What loadtest/gpu_check.sh runs must import on the GPU check machine.

That machine has Python, torch, Triton, transformers (with its own dependencies), safetensors,
numpy and pytest, and none of this project's other dependencies: offline, `make install` fails and
the script falls back to the system python with PYTHONPATH=. (no Ray, FastAPI, psutil, matplotlib,
accelerate, gguf, pytest plugins, ...; no vLLM; FlashInfer only if its wheel is carried).

Each check runs in a subprocess where those packages are absent: every top-level name in
`refused_modules()` (pyproject.toml's dependencies and extras, less what the GPU machine has, plus
vllm and flashinfer) is None in `sys.modules`, so importing it raises ModuleNotFoundError and
`importlib.util.find_spec` returns None, as for a package that is not installed (a meta-path finder
that raises would break the `find_spec` probes of optional packages, transformers' among them, in a
way the GPU machine never sees). An import of them that the code catches (an optional dependency) is
allowed; one that escapes fails the check.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# distributions the GPU check machine has (pyproject names)
GPU_MACHINE = {"torch", "triton", "transformers", "safetensors", "tokenizers", "numpy", "jinja2", "pytest", "ninja"}
# not in pyproject.toml, and not there either
ALSO_REFUSED = {"vllm", "flashinfer"}

ENGINE_MODULES = [
    "serve_app.engine", "serve_app.engine.llm", "serve_app.engine.engine_core", "serve_app.engine.model_runner",
    "serve_app.engine.cuda_graphs", "serve_app.engine.attention_backends", "serve_app.engine.attention_triton",
    "serve_app.engine.attention_flashinfer", "serve_app.engine.memory_profile", "serve_app.engine.input_batch",
    "serve_app.engine.sampler", "serve_app.engine.spec_decode.draft",
]
TEST_MODULES = ["tests.conftest", "tests.engine.conftest", "tests.gpu.test_gpu_exact", "tests.gpu.test_gpu_paths",
                "tests.engine.test_triton_kernels"]
SCRIPT_MODULES = ["loadtest.bench_engine", "loadtest.decode_sweep", "loadtest.engines", "loadtest.compute_floor",
                  "loadtest.worker", "loadtest.report"]

CHILD = r"""
import importlib.util, json, sys

refused = json.loads(sys.argv[1])
preloaded = sorted(set(refused) & {m.partition(".")[0] for m in sys.modules})
assert not preloaded, f"already imported at start-up, cannot be made absent: {preloaded}"
sys.modules.update(dict.fromkeys(refused))
try:
    import psutil  # noqa: F401
except ModuleNotFoundError:
    assert importlib.util.find_spec("psutil") is None
else:
    raise AssertionError("psutil is still importable")
exec(sys.argv[2])
print("OK")
"""


def refused_modules() -> list[str]:
    """Top-level module names of pyproject.toml's dependencies (all extras too) that the GPU machine lacks."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    dists = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-") for r in requirements}
    modules_of: dict[str, set[str]] = {}
    for module, owners in importlib.metadata.packages_distributions().items():
        for owner in owners:
            modules_of.setdefault(owner.lower().replace("_", "-"), set()).add(module)
    names = set(ALSO_REFUSED)
    for dist in dists - GPU_MACHINE:
        # a distribution not installed here still gets its usual module name
        names |= {m for m in modules_of.get(dist, {dist.replace("-", "_")}) if m.isidentifier() and not m.startswith("_") and m not in sys.stdlib_module_names}
    return sorted(names)


def run_child(code: str) -> None:
    """Run `code` in a python without the refused packages (PYTHONPATH=., as gpu_check.sh)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the GPU machine has no pytest plugins to autoload
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(refused_modules()), code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def test_refused_modules_cover_the_dependencies_the_gpu_machine_lacks():
    refused = refused_modules()
    for name in ("ray", "fastapi", "psutil", "matplotlib", "accelerate", "gguf", "prometheus_client", "pytest_timeout", "vllm", "flashinfer"):
        assert name in refused
    for name in ("torch", "triton", "transformers", "numpy", "pytest", "safetensors"):
        assert name not in refused


def test_engine_gpu_tests_and_gpu_check_scripts_import_without_them():
    code = (
        "import importlib\n"
        f"for name in {ENGINE_MODULES + TEST_MODULES + SCRIPT_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "from loadtest import machine, report\n"
        "assert machine.psutil is None\n"
        "info = report.start('bench_engine', 'cuda')['machine']\n"  # the facts need no psutil; its accounting reads NaN
        "assert info['logical_cores'] >= 1 and info['cpu'] and len(info['load_avg_before']) == 3\n"
        "assert machine.tree(1) == [] and machine.own_cpu_s() != machine.own_cpu_s()  # NaN\n"
    )
    run_child(code)


def test_pytest_collects_the_gpu_check_tests_without_them():
    """gpu_check.sh's pytest run: the conftests pytest loads for these files, and the test modules."""
    code = (
        "import sys, pytest\n"
        "rc = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', 'gpu or not gpu',\n"
        "                  'tests/gpu', 'tests/engine/test_triton_kernels.py'])\n"
        "assert rc == 0, f'pytest exit {rc}'\n"
    )
    run_child(code)

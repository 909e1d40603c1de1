"""The gateway must stay torch-free: importing every module of it leaves torch out of sys.modules."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import gateway


def test_gateway_does_not_import_torch():
    modules = sorted(m.name for m in pkgutil.walk_packages(gateway.__path__, "gateway."))
    assert {"gateway.http.app", "gateway.workers.router", "gateway.workers.registry",
            "gateway.text.tokenizer"} <= set(modules)
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            "bad = sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.') or n == 'transformers')\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

"""`lockstep serve`'s HTTP process never imports torch: torch lives in the engine process
(lockstep/server/engine_process.py), and importing it in both would cost every server start
an import of torch and the HTTP process the memory of one. The server test
test_server_engine_process.py checks the running process; this one names the module at fault.
"""

from __future__ import annotations

import subprocess
import sys

# With torch blocked (an import of it raises ImportError): every module of lockstep.server,
# then what `lockstep serve` runs before it starts the engine process (the command line and
# the validated EngineConfig). The control: a module that needs torch does fail to import, so
# the block is real.
_CODE = """
import importlib, pkgutil, sys
sys.modules["torch"] = None
import lockstep.server
for module in pkgutil.walk_packages(lockstep.server.__path__, "lockstep.server."):
    importlib.import_module(module.name)
from lockstep.cli import build_parser
from lockstep.cli_options import engine_options_from_args
from lockstep.config import EngineConfig
args = build_parser().parse_args(["serve", "--model", "random:tiny", "--device", "cpu"])
EngineConfig.from_options(**engine_options_from_args(args))
try:
    importlib.import_module("lockstep.engine.engine")
except ImportError:
    print("blocked")
"""


def test_the_http_process_imports_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "blocked"

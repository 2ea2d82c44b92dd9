"""Import a script of ``simulations/`` (a folder of scripts, not a package) in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SIMULATIONS = Path(__file__).resolve().parents[2] / "simulations"


def load_script(name: str) -> ModuleType:
    """Import ``simulations/<name>.py`` afresh and register it as ``sys.modules[name]``
    (a process pool pickles the script's functions by that module name)."""
    spec = importlib.util.spec_from_file_location(name, SIMULATIONS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

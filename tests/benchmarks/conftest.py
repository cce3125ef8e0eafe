"""The benchmark scripts import their shared helpers as the package `benchmarks` (the repository's
benchmarks/ folder). `python -m pytest` from the repository root finds it on its own; this makes it
found under any launcher or working directory, without touching sys.path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

if "benchmarks" not in sys.modules:
    spec = importlib.util.spec_from_file_location("benchmarks", BENCHMARKS / "__init__.py",
                                                  submodule_search_locations=[str(BENCHMARKS)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks"] = package
    spec.loader.exec_module(package)

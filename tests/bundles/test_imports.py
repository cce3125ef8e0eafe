"""omnigraph.bundles is the ground floor: importing it pulls in the standard library and onnx only."""

from __future__ import annotations

import json
import subprocess
import sys

# Heavy or higher-level packages the graph worker's interpreter need not have.
FORBIDDEN = ("torch", "onnxruntime", "pydantic", "yaml", "fastapi", "uvicorn", "transformers", "tokenizers",
             "safetensors", "prometheus_client", "tqdm")


def test_importing_bundles_loads_no_heavy_or_higher_package() -> None:
    probe = "import json, sys, omnigraph.bundles; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = json.loads(result.stdout)
    top_level = {name.split(".")[0] for name in loaded}
    assert "onnx" in top_level
    assert not top_level & set(FORBIDDEN)
    omnigraph_modules = {name for name in loaded if name.startswith("omnigraph.")}
    assert all(name.startswith("omnigraph.bundles") for name in omnigraph_modules), omnigraph_modules

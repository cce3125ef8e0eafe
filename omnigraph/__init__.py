"""omnigraph: staged pipelines serving System One decision models from verified ONNX bundles.

`Omni`, `AsyncOmni` and `OmniRequestOutput` load on first use, so importing omnigraph (as the
worker process does) stays light.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["AsyncOmni", "Omni", "OmniRequestOutput"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from omnigraph.plugin import omni

        return getattr(omni, name)
    raise AttributeError(f"module 'omnigraph' has no attribute {name!r}")

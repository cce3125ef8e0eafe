"""omnigraph: staged pipelines serving System One decision models from verified ONNX bundles."""

__version__ = "0.1.0"

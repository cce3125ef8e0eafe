"""Graph workers: the process that runs a verified ONNX bundle in ONNX Runtime, the wire it speaks
with its controller, and the controller's client.

This package imports only the standard library, numpy, onnxruntime, onnx and omnigraph.bundles, so
a worker runs in an interpreter that has nothing else. Import the submodules directly
(``omnigraph.workers.client``, ``.wire``, ``.route``, ``.placement``, ``.errors``): this file
imports nothing, so ``python -m omnigraph.workers.worker`` loads only what the worker needs.
"""

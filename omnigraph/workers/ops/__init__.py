"""The omnigraph custom-op library (ONNX Runtime domain `omnigraph`): CUDA/C++ sources in csrc/,
their build (`build.build_library`), the worker-side checks (`loader`), NumPy references
(`reference`), one-op graphs (`graphs`) and the GPU self-test (`selftest`). See README.md."""

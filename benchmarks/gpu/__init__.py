"""The GPU machine's benchmarks. Those that share ../laya_gpu.py run from the repository root as
`python3 -m benchmarks.gpu.NAME` (or as scripts with the repository on PYTHONPATH)."""

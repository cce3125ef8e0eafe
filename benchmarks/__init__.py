"""Benchmarks: scripts run from the repository root (`python benchmarks/NAME.py` or
`python -m benchmarks.NAME`), sharing the helpers of this folder. Results: results/RESULTS.md."""

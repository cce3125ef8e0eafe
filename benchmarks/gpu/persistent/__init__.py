"""Issue 19's persistent weight-streaming layer kernel (research, not shipped): the CUDA source and
its NumPy contract, built and timed by ../persistent_run.sh and ../persistent_bench.py."""

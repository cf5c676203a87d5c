"""The GPU check (benchmarks/gpu_check.py, docs/gpu.md): the command (check), its offline build, its pair (measure)."""

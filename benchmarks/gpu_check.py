"""``python benchmarks/gpu_check.py ARGS``: runs benchmarks.gpu.check as ``python -m benchmarks.gpu.check ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.gpu.check")

"""``python benchmarks/cpu_kernels.py ARGS``: runs benchmarks.decode.cpu_kernels as ``python -m benchmarks.decode.cpu_kernels ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.decode.cpu_kernels")

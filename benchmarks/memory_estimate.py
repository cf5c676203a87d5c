"""``python benchmarks/memory_estimate.py ARGS``: runs benchmarks.process.memory_estimate as ``python -m benchmarks.process.memory_estimate ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.process.memory_estimate")

"""``python benchmarks/structured.py ARGS``: runs benchmarks.process.structured as ``python -m benchmarks.process.structured ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.process.structured")

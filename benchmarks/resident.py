"""``python benchmarks/resident.py ARGS``: runs benchmarks.process.resident as ``python -m benchmarks.process.resident ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.process.resident")

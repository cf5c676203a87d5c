"""``python benchmarks/whole_process.py ARGS``: runs benchmarks.process.whole_process as ``python -m benchmarks.process.whole_process ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.process.whole_process")

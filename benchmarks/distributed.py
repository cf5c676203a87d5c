"""``python benchmarks/distributed.py ARGS``: runs benchmarks.process.distributed as ``python -m benchmarks.process.distributed ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.process.distributed")

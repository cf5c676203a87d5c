"""``python benchmarks/concurrency.py ARGS``: runs benchmarks.process.concurrency as ``python -m benchmarks.process.concurrency ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.process.concurrency")

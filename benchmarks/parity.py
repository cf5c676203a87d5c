"""``python benchmarks/parity.py ARGS``: runs benchmarks.process.parity as ``python -m benchmarks.process.parity ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.process.parity")

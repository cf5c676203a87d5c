"""``python benchmarks/checkout_ab.py ARGS``: runs benchmarks.process.checkout_ab as ``python -m benchmarks.process.checkout_ab ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.process.checkout_ab")

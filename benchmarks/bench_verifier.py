"""``python benchmarks/bench_verifier.py ARGS``: runs benchmarks.decode.bench_verifier as ``python -m benchmarks.decode.bench_verifier ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.decode.bench_verifier")

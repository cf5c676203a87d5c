"""``python benchmarks/head_to_head.py ARGS``: runs benchmarks.decode.head_to_head as ``python -m benchmarks.decode.head_to_head ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.decode.head_to_head")

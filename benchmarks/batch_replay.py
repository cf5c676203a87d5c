"""``python benchmarks/batch_replay.py ARGS``: runs benchmarks.replay.batch as ``python -m benchmarks.replay.batch ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.replay.batch")

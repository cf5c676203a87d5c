"""``python benchmarks/tree_replay.py ARGS``: runs benchmarks.replay.tree as ``python -m benchmarks.replay.tree ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.replay.tree")

"""``python benchmarks/planner_replay.py ARGS``: runs benchmarks.replay.planner as ``python -m benchmarks.replay.planner ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.replay.planner")

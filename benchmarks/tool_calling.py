"""``python benchmarks/tool_calling.py ARGS``: runs benchmarks.process.tool_calling as ``python -m benchmarks.process.tool_calling ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.process.tool_calling")

"""``python benchmarks/prompt_cache.py ARGS``: runs benchmarks.process.prompt_cache as ``python -m benchmarks.process.prompt_cache ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.process.prompt_cache")

"""``python benchmarks/gpu_predict.py ARGS``: runs benchmarks.gpu.predict as ``python -m benchmarks.gpu.predict ARGS`` does (see there)."""

if __name__ == "__main__":
    from launch import run_module  # benchmarks/launch.py, beside this script

    run_module("benchmarks.gpu.predict")

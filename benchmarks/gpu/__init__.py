"""The GPU check: one prepared command that builds, tests and measures localspec on a CUDA machine
(check: the steps' runner; build, bundle: offline from a carried bundle; steps, features,
measure: what it checks and measures; models: the shaped pair; report: its state and table), and
the GPU speedups predicted from what it measured and acceptance traces recorded on a CPU
(predict, traces, decisions). docs/gpu.md."""

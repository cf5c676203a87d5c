"""Measurements in this process: localspec head to head with llama.cpp's speculative decoding on the
default pair (head_to_head and its report), paired verifier efficiency on the same drafts
(efficiency), CPU kernel configurations (cpu_kernels) and the verifier micro-benchmark
(bench_verifier)."""

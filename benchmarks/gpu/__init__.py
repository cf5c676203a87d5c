"""The GPU check (benchmarks/gpu_check.py, docs/gpu.md): check runs it; bundle makes what travels to
an offline CUDA machine; build builds llama-cpp-python with CUDA there from it; measure writes a
pair shaped like the default one and measures its target's cost curve; report writes the result."""

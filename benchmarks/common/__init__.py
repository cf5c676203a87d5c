"""What the benchmarks share: prompts by name, running localspec and llama.cpp's tools as timed
processes (one result type), the default target measured in this process, the host header and
the shared command-line options."""

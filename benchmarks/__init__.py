"""The repository's benchmarks, as one package (docs/design.md, "The benchmarks package").

* common: what every benchmark shares: the prompts by name (drawn from localspec.bench.prompts,
  the one registry), one way to run localspec as a process and one result type (runs), one way to
  build and run llama.cpp's tools (llama_tools), the default target measured in this process
  (target), the host header, the shared options;
* replay: recorded answers decoded again through the engine's policy interface with the real
  planner, its variants or fixed policies, and the n-gram ceiling (no model, no timing noise);
* gpu: the GPU check (its bundle, the CUDA build, the shaped pair and its cost curve, the report);
* decode: measurements in this process on the real pair (head to head with llama.cpp, paired
  verifier efficiency, CPU kernel configurations, the verifier micro-benchmark);
* process: whole-process measurements, each figure a fresh process (the default against the
  target alone, resident services, the prompt cache, structured output, tool calls, two
  checkouts side by side, a remote target).

Each command the docs show (``python benchmarks/head_to_head.py ...``) is a script beside this
file that runs its module as ``python -m benchmarks.decode.head_to_head ...`` does (launch.py).
"""

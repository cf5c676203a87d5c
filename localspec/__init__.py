"""localspec: local speculative decoding on llama.cpp with provably lossless verifiers."""

import os

# numpy's OpenBLAS threads busy-wait on the cores llama.cpp and the verifier need; localspec
# does no BLAS work. Only takes effect if numpy is not imported yet; an explicit setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"

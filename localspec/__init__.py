"""localspec: local speculative decoding on llama.cpp with provably lossless verifiers."""

__version__ = "0.1.0"

"""localspec: local speculative decoding on llama.cpp with provably lossless verifiers.

    from localspec import default_pair, stream_generate
"""

import os

# numpy's OpenBLAS threads busy-wait on the cores llama.cpp and the verifier need; localspec
# does no BLAS work. Only takes effect if numpy is not imported yet; an explicit setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"

_API = ("load_model", "default_pair", "stream_generate", "generate", "Response")


def __getattr__(name: str):
    """The generation API, imported on first use (it loads llama.cpp)."""
    if name in _API:
        from localspec import api

        return getattr(api, name)
    raise AttributeError(f"module 'localspec' has no attribute {name!r}")


__all__ = list(_API)

"""localspec: local speculative decoding on llama.cpp with provably lossless verifiers.

    from localspec import default_pair, stream_generate
"""

__version__ = "0.1.0"

_API = ("load_model", "default_pair", "stream_generate", "generate", "astream_generate", "agenerate", "Generation",
        "Response")
_MEMORY = ("estimate_memory", "MemoryEstimate", "ModelMemory")  # localspec.llama.memory: before loading


def __getattr__(name: str):
    """The generation API and the memory estimate, imported on first use (they load llama.cpp)."""
    if name in _API:
        from localspec import api

        return getattr(api, name)
    if name in _MEMORY:
        from localspec.llama import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'localspec' has no attribute {name!r}")


__all__ = list(_API + _MEMORY)

"""Model definitions that ship with localspec: the registry of known pairs (``registry.json``) and
the tiny-model generator (``tiny.py``: test models, and the model the CPU kernel check quantizes)."""

"""Model definitions that ship with localspec: the registry of known pairs (``registry.json``)."""

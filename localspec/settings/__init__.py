"""Settings, one type per concept, each validated once when it is made, with the defaults; and
where they come from (the environment, the files localspec reads and writes). Leaves: no numpy,
no llama.cpp, so ``localspec --help`` stays fast and every layer can import them.

* :mod:`.generation`: :class:`GenerationConfig` (everything one generation needs besides the
  models and the prompt), the one settings path of the CLI, the API and the server;
* :mod:`.sampling`: :class:`SamplingParams`; :mod:`.shape`: :class:`Shape` (what to draft);
* :mod:`.constraints`: :class:`Constraint` (what the output must match);
* :mod:`.models`: :class:`ModelOptions`, :class:`PairOptions` (how models load);
* :mod:`.endpoints`: RPC server addresses; :mod:`.validation`: the checks settings share;
* :mod:`.environment`: every ``LOCALSPEC_*`` variable; :mod:`.locations`: where localspec keeps its
  files; :mod:`.files`: the one place files are opened.

The public types are importable from here too (``from localspec.settings import
GenerationConfig``), each on first use.
"""

_PUBLIC = {"GenerationConfig": "generation", "DEFAULTS": "generation", "SamplingParams": "sampling",
           "DEFAULT_SAMPLING": "sampling", "Shape": "shape", "Constraint": "constraints", "ModelOptions": "models",
           "PairOptions": "models"}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f"localspec.settings.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'localspec.settings' has no attribute {name!r}")


__all__ = list(_PUBLIC)

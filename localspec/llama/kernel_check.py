"""The child process of a CPU kernel check (``localspec.llama.kernel_verdicts``): ``python -m
localspec.llama.kernel_check CONFIG TYPE...`` quantizes a tiny model to each weight type with llama.cpp's
own quantizer, decodes with the configuration and with the plain kernels, and compares the logits.
It exits 0 when they agree; a configuration that crashes kills only this process."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from localspec.errors import ModelError
from localspec.llama import backend, tiny_model
from localspec.llama.buffer_types import CHECK_FTYPES
from localspec.llama.model import Model
from localspec.settings.models import ModelOptions

CHECK_TOLERANCE = 0.1  # relative RMS difference between a configuration's logits and the plain kernels'


def _tiny_models(directory: Path, types: Sequence[str]) -> list[tuple[str, Path]]:
    """A tiny random model quantized by llama.cpp to each weight type (dimensions that the
    quantized types, CPU_REPACK's interleaves and AMX's tiles all take)."""
    backend.init()  # llama.cpp's quantizer logs through localspec's quiet callback
    source = tiny_model.write_check_model(directory / "check-f32.gguf")
    try:
        return [(t, tiny_model.quantize(source, directory / f"check-{t}.gguf", CHECK_FTYPES[t])) for t in types]
    except RuntimeError as exc:
        raise ModelError(str(exc)) from None


def _logits(path: Path, config: str) -> np.ndarray:
    """Decode a 24-token batch, then one token twice; the logits of the last three rows."""
    options = ModelOptions(ctx_size=64, batch_size=32, threads=1, n_seq_max=1, cache_type="f32",
                           flash_attn="off", cpu_kernels=config)
    with Model(path, options) as model:
        tokens = [1 + (7 * i) % 300 for i in range(24)]
        model.decode(tokens, range(24))
        rows = [model.logits_array(24)[-1].copy()]
        for pos, token in ((24, 5), (25, 9)):
            model.decode([token], [pos])
            rows.append(model.logits_array(1)[0].copy())
        return np.stack(rows)


def compare_logits(weight_type: str, got: np.ndarray, want: np.ndarray) -> float:
    """The relative RMS difference of a configuration's logits from the plain kernels'; beyond
    CHECK_TOLERANCE (a wrong layout is off by whole logits) the child fails."""
    diff = float(np.sqrt(np.mean((got - want) ** 2)) / max(float(np.sqrt(np.mean(want ** 2))), 1e-12))
    if not np.isfinite(diff) or diff > CHECK_TOLERANCE:
        raise SystemExit(f"{weight_type}: logits differ from the plain kernels' by {diff:.3g} (relative RMS)")
    return diff


def check_in_child(config: str, types: Sequence[str]) -> str:
    """The child's work: each type's tiny model under `config` against the plain kernels."""
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="localspec-check-") as tmp:
        for weight_type, path in _tiny_models(Path(tmp), types):
            got = _logits(path, config)
            worst = max(worst, compare_logits(weight_type, got, _logits(path, "plain")))
    return f"{'/'.join(types)} logits within {worst:.2g} of the plain kernels'"


def main(argv: Sequence[str] | None = None) -> int:
    """The check's child process: `python -m localspec.llama.kernel_check CONFIG TYPE...`; 0 when it passes."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] not in ("llama", "repack", "plain") or not set(args[1:]) <= set(CHECK_FTYPES):
        print("usage: python -m localspec.llama.kernel_check llama|repack|plain TYPE [TYPE...]  "
              f"(types: {', '.join(CHECK_FTYPES)})", file=sys.stderr)
        return 2
    print(check_in_child(args[0], args[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

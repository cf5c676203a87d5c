"""Verification and its proofs: the C verifier's binding (verifier), an independent numpy
reference of every method (reference), exact and statistical losslessness checks (lossless) and
the chi-square test they use (stats). ``localspec check`` runs them (localspec.bench.checks)."""

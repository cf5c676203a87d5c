"""Verification and its proofs: the C verifier's binding (verifier), an independent numpy
reference of every method (reference), exact and statistical losslessness checks (lossless) and
the chi-square test they use (stats), and the checks ``localspec check`` runs with them (checks)."""

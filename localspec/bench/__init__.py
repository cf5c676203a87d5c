"""The engine exercised as a user asks: what ``localspec bench`` measures (runs: verifiers x
draft shapes x drafters x temperatures, each row side by side with target-only decoding, on the
built-in prompts or a user's: prompts) and the losslessness self-checks ``localspec check`` runs
(checks: the verifier's exact and Monte Carlo toy checks, the model-pair check). The benchmarks
of the repository (benchmarks/) take their prompt texts from the same registry."""

"""What ``localspec bench`` measures: verifiers x draft shapes x drafters x temperatures, each row
side by side with target-only decoding (runs), on the built-in prompts or a user's (prompts).
The benchmarks of the repository (benchmarks/) take their prompt texts from the same registry."""

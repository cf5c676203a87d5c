"""Speculative decoding: the step loop (engine), what it drafts with (drafters, the n-gram
lookup, the draft tree), how deep it drafts (planner) and the per-machine cost profiles it
plans with, and which draft can draft for which target (pairing)."""

"""Recorded answers decoded again, with no model and no timing noise: through the engine's policy
interface with the real planner or a variant of it (steps, planners), against the best fixed
policies found in hindsight (policies) and the n-gram ceiling (ceiling); the planner's table
(planner), trees of the lookup's alternatives (tree) and several calls sharing each target pass
(batch)."""

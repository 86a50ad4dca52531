"""Where the plan comes from and how it is kept honest: the Planner (profiles, search), the
hardware and model probes and their cache, budgets, applying a plan to a model, the plan check
and re-planning. What-if planning is a launcher command (runtime/commands/)."""

"""The Engine a script drives (forward, backward, step) and what one update needs: the window's
totals, the update's decisions, loss scaling, the schedule, stop signals, and the engines alive
in the process."""

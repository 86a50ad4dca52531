"""What ``logging.trace`` records under the run folder: a Chrome trace of a few updates on every
thread, and the memory timeline of one update that ``protrain-run --plot`` draws."""

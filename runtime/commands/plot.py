"""``protrain-run --plot``'s input: the memory timeline file a traced run writes
(``tracing/timeline_file.py`` defines its format; the engine's tracing writes it)."""

from __future__ import annotations

from protrain.runtime.observability.timeline_file import Timeline, read_timeline, timeline_path

__all__ = ["Timeline", "read_timeline", "timeline_path"]

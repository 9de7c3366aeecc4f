"""Rubric markdown files bundled with agent-monitor (the repository's criteria/ folder)."""

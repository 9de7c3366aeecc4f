"""Input limits: every payload, image, text and label is bounded (the daemon may pass its own size limits)."""

from __future__ import annotations

MAX_PAYLOAD_BYTES = 32 * 1024 * 1024
"""Default cap on one MQTT payload, checked before any parsing."""
MAX_IMAGE_BYTES = 8 * 1024 * 1024
"""Default cap on one image's decoded bytes (override with context `{"max_image_bytes": n}`)."""
MAX_IMAGES = 16
MAX_TASK_CHARS = 100_000
MAX_STEP_CHARS = 200_000
MAX_STEP_INDEX = 1_000_000
MAX_LABELS = 16
MAX_LABEL_KEY_CHARS = 64
MAX_LABEL_VALUE_CHARS = 256
MAX_META_BYTES = 64 * 1024
MAX_META_DEPTH = 16
MAX_RUN_ID_CHARS = 128
MAX_CRITERIA = 16
"""Criteria one rubric from the network may have: each judged one costs a judge call per step and repeat."""
MAX_CRITERION_BYTES = 4 * 1024
"""One criterion of a network rubric, as compact JSON (name, description, rules)."""
MAX_RUBRIC_BYTES = 32 * 1024
"""A whole network rubric (`start.criteria`) as compact JSON (criteria, extractors, thresholds)."""
MAX_JUDGE_CALLS_PER_STEP = 64
"""Judge calls one scoring of one run may make (judged criteria x repeats); a start over it is refused."""
MAX_JUDGE_CALLS_PER_RUN_MINUTE = 600
"""Judge calls one run may make in any 60 s; past it the run's newest prefix waits (steps coalesce)."""

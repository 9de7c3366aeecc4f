"""Input limits: every payload, image, text and label is bounded (the daemon may pass its own
size limits)."""

from __future__ import annotations

from ..criteria import MAX_CRITERIA, MAX_CRITERION_BYTES, MAX_RUBRIC_BYTES

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

__all__ = [
    "MAX_CRITERIA",
    "MAX_CRITERION_BYTES",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_LABELS",
    "MAX_LABEL_KEY_CHARS",
    "MAX_LABEL_VALUE_CHARS",
    "MAX_META_BYTES",
    "MAX_META_DEPTH",
    "MAX_PAYLOAD_BYTES",
    "MAX_RUBRIC_BYTES",
    "MAX_RUN_ID_CHARS",
    "MAX_STEP_CHARS",
    "MAX_STEP_INDEX",
    "MAX_TASK_CHARS",
]

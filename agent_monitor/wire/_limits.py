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

"""The OTLP traces door: runs that are traces an agent exports over OTLP/HTTP."""

from ._receiver import OtlpReceiver

__all__ = [
    "OtlpReceiver",
]

"""Judge backends behind one async interface."""

from .base import BaseJudge, Judge, JudgeError, JudgeRequest, JudgeResponse, Usage

__all__ = ["BaseJudge", "Judge", "JudgeError", "JudgeRequest", "JudgeResponse", "Usage"]

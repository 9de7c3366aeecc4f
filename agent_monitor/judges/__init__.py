"""Judge backends behind one async interface."""

from ..progress import Usage
from .base import BaseJudge, Judge, JudgeError, JudgeRequest, JudgeResponse

__all__ = ["BaseJudge", "Judge", "JudgeError", "JudgeRequest", "JudgeResponse", "Usage"]

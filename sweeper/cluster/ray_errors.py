"""What a Ray error says, in one line a user can read.

Ray's text for an actor whose creation task raised (or a task that raised) carries the whole remote traceback, the
worker's terminal colour codes, ``pid=…, ip=…, actor_id=…`` and the carets Python's traceback draws under the
failing call; the cause, the remote exception's own last line, comes after all of that, where a capped one-line
summary cuts it away. ``cause_line`` keeps the cause.
"""

from __future__ import annotations

import re

_COLOUR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CARETS = re.compile(r"^[\s^~]+$")
# Ray's identification of the dead worker, repeated in every message and never the cause.
_WORKER_IDS = re.compile(r"\b(?:class_name|actor_id|pid|namespace|ip): \S+\s*")
# The last line of a Python traceback: "module.ExceptionType: message" (or the type alone).
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure)\b")
MAX_CHARS = 300


def strip_colour(text: str) -> str:
    return _COLOUR.sub("", text)


def cause_line(exc: BaseException) -> str:
    """The error's cause in one line: the remote exception's last line when Ray carries a traceback, else the text
    itself, without colour codes or carets, whitespace collapsed, at most ``MAX_CHARS`` characters."""
    lines = [line.strip() for line in strip_colour(str(exc)).splitlines()]
    lines = [line for line in lines if line and not _CARETS.match(line)]
    has_traceback = any(line.startswith(("File \"", "Traceback (most recent call last)")) for line in lines)
    if has_traceback:
        causes = [line for line in lines if _EXCEPTION_LINE.match(line)]
        text = causes[-1] if causes else lines[-1]
    else:
        text = " ".join(lines) or type(exc).__name__
    text = " ".join(_WORKER_IDS.sub("", text).split())
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."


__all__ = ["cause_line", "strip_colour"]

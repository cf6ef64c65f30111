"""Stand-ins the search's unit tests share (no Ray, no Megatron: each test says what it stands in for)."""

from __future__ import annotations


class EverythingSupported:
    """Stand-in for the trial host, of which the frontier asks only whether a layout can run here: every layout can."""

    def unsupported(self, model: object, layout: object) -> None:
        return None

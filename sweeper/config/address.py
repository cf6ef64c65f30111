"""Ray addresses as the search YAML (``cluster.address``) and ``--address`` accept them."""

from __future__ import annotations

import re

# What cluster.address and --address accept. A bare host (no port) is refused: Ray has no default GCS port to
# fall back on, and guessing one would send the connection somewhere the user did not name.
ADDRESS_FORMS = "auto, local, HOST:PORT or ray://HOST:PORT"
_ADDRESS = re.compile(r"(?P<scheme>ray://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252}))"
                      r":(?P<port>[0-9]{1,5})")


def check_address(value: str) -> str:
    """``value`` if it is one of ADDRESS_FORMS; raises ValueError saying what is accepted."""
    if value in ("auto", "local"):
        return value
    match = _ADDRESS.fullmatch(value)
    if match is None or not 1 <= int(match.group("port")) <= 65535:
        raise ValueError(f"must be {ADDRESS_FORMS}, got {value!r}")
    return value


def split_address(value: str) -> tuple[str, int]:
    """Host (without IPv6 brackets) and port of a HOST:PORT or ray://HOST:PORT address checked by check_address."""
    match = _ADDRESS.fullmatch(value)
    if match is None:
        raise ValueError(f"not HOST:PORT: {value!r}")
    return match.group("host").strip("[]"), int(match.group("port"))

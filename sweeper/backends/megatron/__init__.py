"""The megatron-core trial backend: the only package in sweeper that imports megatron.

``run_rank(request) -> RankReport`` runs one rank of a smoke trial. Importing this package is cheap: megatron
is imported only when a rank actually runs (and only after the request was checked for what this backend
supports).
"""

from sweeper.backends.megatron.smoke import run_rank

__all__ = ["run_rank"]

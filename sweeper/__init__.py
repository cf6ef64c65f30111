"""sweeper: find the best stable Megatron parallel layout for a model on a cluster before the real run."""

__version__ = "0.1.0"

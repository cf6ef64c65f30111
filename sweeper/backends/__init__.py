"""Trial backends: the code that runs one rank of a smoke run. Only ``backends.megatron`` imports megatron."""

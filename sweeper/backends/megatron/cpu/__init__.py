"""The CPU stand-ins: what megatron-core's local (non Transformer Engine) path needs to run on gloo.

compat.py redirects megatron-core's hard-coded CUDA calls to the CPU and mends what fails without Transformer
Engine; mamba.py puts torch Mamba2 kernels where mamba_ssm's are missing; spec.py adapts the local layer spec with
the modules Megatron's local path lacks: CP attention (attention.py), SP norms (norm.py), MLA's duplicated linear
(linear.py) and batched experts (experts.py). Importing this package imports nothing; docs/MEGATRON_ON_CPU.md
holds the measurements behind each.
"""

"""Pure-torch Mamba2 kernels so that megatron-core's ``MambaMixer`` runs where mamba_ssm (Triton, CUDA) is absent.

megatron-core's ``ssm/mamba_mixer.py`` (0.16.1 and 0.19.2) calls three mamba_ssm pieces:
``mamba_chunk_scan_combined`` (the chunked SSD scan, used by the prefill / ``use_mamba_mem_eff_path=False`` path),
``mamba_split_conv1d_scan_combined`` (split of the fused in-projection + causal depthwise conv + SSD scan + z
gating, the default training path) and the gated ``RMSNorm``. This module implements them in torch from the Mamba2
(SSD) definition, with the call signatures and tensor layouts the mixer uses: per head
``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T`` and ``y_t = h_t C_t + D x_t`` (A a scalar per head, B/C shared by the
heads of a group), computed per chunk as a masked attention-like product inside the chunk plus a state passed
between chunks, so nothing loops over time steps. The result is exact (not an approximation) for any chunk size;
autograd provides the backward. ``install()`` puts them into megatron-core's Mamba modules when the real kernels are
missing, and ``local_mamba_stack_spec()`` is the hybrid stack spec built from Megatron's local (non Transformer
Engine) modules. Packed sequences (``seq_idx``, ``cu_seqlens``) are refused with ``NotImplementedError``:
megatron-core itself refuses packed Mamba training without the causal-conv1d and mamba_ssm packages.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import threading
import types
from typing import Any

import torch
import torch.nn.functional as F

from sweeper.backends.megatron.cpu.patches import record, replace

_INF_LIMIT = (0.0, float("inf"))
_lock = threading.Lock()

# --------------------------------------------------------------------------------------------------------------
# The chunked SSD scan


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``i >= j`` (0 on the diagonal), ``-inf`` above it.

    Summed directly rather than as a difference of two cumulative sums: the difference loses digits when the
    cumulative log-decay grows large, and ``exp(-inf) = 0`` masks the non-causal half with a zero gradient.
    """
    t = a.shape[-1]
    strictly_below = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    # terms[..., k, j] = a_k where k > j; a cumulative sum over k gives the sum over j < k <= i.
    terms = a.unsqueeze(-1).expand(*a.shape, t).masked_fill(~strictly_below, 0.0)
    sums = terms.cumsum(dim=-2)
    causal = torch.ones(t, t, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~causal, float("-inf"))


# At most this many steps per chunk on the CPU: Megatron's 128 makes one chunk of a proxy's 128-token sequence, whose
# within-chunk products (and their saved activations) are 128 x 128 per head. 32 measured on one rank of the
# Nemotron-3-Nano proxy (BF16, 2 micro-batches of 2 x 128 tokens): 2.81 s per step against 4.28 s, and 1.43 GiB
# resident against 2.16 GiB after it (16: 2.58 s; 64: 3.40 s).
CPU_CHUNK = 32


def _ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_states: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan ``y_t = C_t h_t`` for x (b,l,h,p), dt (b,l,h) already discretised, A (h), B/C (b,l,g,n);
    returns y (b,l,h,p) and the final state (b,h,p,n), in x's dtype."""
    b, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    per_group = nheads // ngroups
    # The chunk size changes the cost, never the result: no point padding a short sequence up to a long chunk, and
    # on the CPU at most CPU_CHUNK (the within-chunk products and their saved activations grow with its square).
    q = max(1, min(chunk_size, seqlen, CPU_CHUNK))
    nchunks = math.ceil(seqlen / q)
    pad = nchunks * q - seqlen

    log_decay = dt * A  # (b, l, h)
    x_dt = x * dt.unsqueeze(-1)  # (b, l, h, p)
    if pad:
        # Padded steps have dt = 0: no decay and no input, so neither the outputs nor the final state change.
        log_decay = F.pad(log_decay, (0, 0, 0, pad))
        x_dt = F.pad(x_dt, (0, 0, 0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))

    # Chunked views: heads split as (group, head in group) since head i reads group i // per_group.
    x_dt = x_dt.reshape(b, nchunks, q, ngroups, per_group, headdim)
    B = B.reshape(b, nchunks, q, ngroups, dstate)
    C = C.reshape(b, nchunks, q, ngroups, dstate)
    a = log_decay.reshape(b, nchunks, q, nheads).permute(0, 3, 1, 2)  # (b, h, c, q)

    seg = _segment_sums(a)  # (b, h, c, q, q): log decay from step j (exclusive) to step i (inclusive)
    decay_within = torch.exp(seg).reshape(b, ngroups, per_group, nchunks, q, q)
    decay_from_start = torch.exp(a.cumsum(dim=-1))  # from the chunk's entry state through step i
    decay_to_end = torch.exp(seg[..., -1, :])  # from step j (exclusive) to the chunk's last step
    chunk_log_decay = a.sum(dim=-1)  # (b, h, c)

    def per_step(t: torch.Tensor) -> torch.Tensor:  # (b, h, c, q) -> (b, c, q, g, r, 1)
        return t.reshape(b, ngroups, per_group, nchunks, q).permute(0, 3, 4, 1, 2).unsqueeze(-1)

    # 1. Inside each chunk: a causal, decay-weighted "attention" of C over B applied to dt * x.
    scores = torch.einsum("bcign,bcjgn->bgcij", C, B).unsqueeze(2) * decay_within  # (b, g, r, c, q, q)
    y = torch.einsum("bgrcij,bcjgrp->bcigrp", scores, x_dt)

    # 2. The state each chunk leaves behind from its own inputs.
    chunk_states = torch.einsum("bcjgn,bcjgrp->bcgrpn", B, x_dt * per_step(decay_to_end))

    # 3. States entering each chunk: a decay-weighted sum over all earlier chunks (and the initial state).
    if initial_states is None:
        first = chunk_states.new_zeros(b, 1, ngroups, per_group, headdim, dstate)
    else:
        first = initial_states.to(chunk_states.dtype).reshape(b, 1, ngroups, per_group, headdim, dstate)
    states = torch.cat([first, chunk_states], dim=1)  # (b, c+1, g, r, p, n)
    between = torch.exp(_segment_sums(F.pad(chunk_log_decay, (1, 0))))  # (b, h, c+1, c+1)
    between = between.reshape(b, ngroups, per_group, nchunks + 1, nchunks + 1)
    entering = torch.einsum("bgrck,bkgrpn->bcgrpn", between, states)

    # 4. What the entering state contributes to each step of its chunk.
    y = y + torch.einsum("bcign,bcgrpn->bcigrp", C, entering[:, :nchunks]) * per_step(decay_from_start)

    y = y.reshape(b, nchunks * q, nheads, headdim)[:, :seqlen]
    final = entering[:, nchunks].reshape(b, nheads, headdim, dstate)
    return y, final


def _check_unsupported(seq_idx: Any, cu_seqlens: Any = None, return_varlen_states: bool = False, **extra: Any) -> None:
    if seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError(
            "packed / variable-length sequences (seq_idx, cu_seqlens, return_varlen_states) are not supported by "
            "sweeper's torch Mamba2 kernels; megatron-core needs causal-conv1d and mamba_ssm for packed Mamba"
        )
    given = sorted(name for name, value in extra.items() if value is not None)
    if given:
        raise NotImplementedError(f"sweeper's torch Mamba2 kernels do not support {', '.join(given)}")


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = _INF_LIMIT,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan with mamba_ssm's signature.

    x (b,l,h,p); dt (b,l,h); A (h); B, C (b,l,g,n) with h a multiple of g; D (h) or (h,p); z (b,l,h,p) gates the
    output as ``y * silu(z)``; dt becomes ``clamp(softplus(dt + dt_bias))`` (each step where asked);
    initial_states (b,h,p,n). Returns y (b,l,h,p) in x's dtype, and the final state (b,h,p,n, float32 or wider)
    when ``return_final_states``.
    """
    _check_unsupported(seq_idx, cu_seqlens, return_varlen_states, chunk_indices=chunk_indices,
                       chunk_offsets=chunk_offsets)
    if x.dim() != 4 or dt.dim() != 3 or B.dim() != 4 or C.dim() != 4:
        raise ValueError(f"expected x (b,l,h,p), dt (b,l,h), B/C (b,l,g,n); got x {tuple(x.shape)}, "
                         f"dt {tuple(dt.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)}")
    b, seqlen, nheads, headdim = x.shape
    ngroups = B.shape[2]
    if dt.shape != (b, seqlen, nheads) or A.shape != (nheads,) or C.shape != B.shape or B.shape[:2] != (b, seqlen):
        raise ValueError(f"inconsistent shapes: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    if nheads % ngroups:
        raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")

    # At least float32 inside, as the Triton kernels accumulate; float64 inputs stay float64.
    compute = torch.promote_types(x.dtype, torch.float32)
    dt = dt.to(compute)
    if dt_bias is not None:
        dt = dt + dt_bias.to(compute)
    if dt_softplus:
        dt = F.softplus(dt)  # torch's threshold (20) is the one mamba_ssm uses
    if tuple(dt_limit) != _INF_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    xc = x.to(compute)
    y, final = _ssd(xc, dt, A.to(compute), B.to(compute), C.to(compute), chunk_size, initial_states)
    if D is not None:
        if D.shape == (nheads,):
            y = y + xc * D.to(compute).reshape(1, 1, nheads, 1)
        elif D.shape == (nheads, headdim):
            y = y + xc * D.to(compute)
        else:
            raise ValueError(f"D must have shape ({nheads},) or ({nheads}, {headdim}), got {tuple(D.shape)}")
    if z is not None:
        y = y * F.silu(z.to(compute))
    y = y.to(x.dtype)
    return (y, final) if return_final_states else y


def _causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """x (b,l,d), weight (d,w): ``out_t = bias + sum_k weight[:, k] * x_{t-w+1+k}``, then silu if asked."""
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"conv activation {activation!r} (supported: None, 'silu', 'swish')")
    seqlen, width = x.shape[1], weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
    out = out[..., :seqlen].transpose(1, 2)
    return F.silu(out) if activation is not None else out


def mamba_split_conv1d_scan_combined(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = _INF_LIMIT,
    return_final_states: bool = False,
    activation: str | None = "silu",
    rmsnorm_weight: torch.Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: torch.Tensor | None = None,
    outproj_bias: torch.Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """The mixer's training path with mamba_ssm's signature: split ``zxbcdt`` (b,l, z | x B C | dt), causal
    depthwise conv + activation over ``x B C``, the SSD scan with ``softplus(dt + dt_bias)``, then either
    ``y * silu(z)`` (no ``rmsnorm_weight``) or the gated RMSNorm over groups of ``d_inner / ngroups``, then the
    optional output projection. D (h) needs ``headdim``; D (h,p) implies it. Returns (b,l,d_inner) — or
    (b,l,d_model) with ``outproj_weight`` — and the final state when ``return_final_states``."""
    _check_unsupported(seq_idx)
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim is required when D has one value per head")
        nheads = D.shape[0]
    else:
        nheads, headdim = D.shape
    d_inner = nheads * headdim
    conv_dim = conv1d_weight.shape[0]
    dstate, rest = divmod(conv_dim - d_inner, 2 * ngroups)
    if rest or dstate <= 0:
        raise ValueError(f"conv1d_weight has {conv_dim} channels; expected d_inner ({d_inner}) + 2 * ngroups "
                         f"({ngroups}) * d_state")
    extra = zxbcdt.shape[-1] - (d_inner + conv_dim + nheads)
    if extra:
        raise NotImplementedError(
            f"zxbcdt has {extra} channels beyond z, x, B, C, dt (a non-SSM MLP branch); Megatron's mixer has none"
        )
    b, seqlen = zxbcdt.shape[:2]
    z, xBC, dt = torch.split(zxbcdt, [d_inner, conv_dim, nheads], dim=-1)
    xBC = _causal_depthwise_conv(xBC, conv1d_weight, conv1d_bias, activation)
    x, B, C = torch.split(xBC, [d_inner, ngroups * dstate, ngroups * dstate], dim=-1)
    result = mamba_chunk_scan_combined(
        x.reshape(b, seqlen, nheads, headdim),
        dt,
        A,
        B.reshape(b, seqlen, ngroups, dstate),
        C.reshape(b, seqlen, ngroups, dstate),
        chunk_size,
        D=D,
        z=z.reshape(b, seqlen, nheads, headdim) if rmsnorm_weight is None else None,
        dt_bias=dt_bias,
        initial_states=initial_states,
        dt_softplus=True,
        dt_limit=dt_limit,
        return_final_states=return_final_states,
    )
    y, final = result if isinstance(result, tuple) else (result, None)
    y = y.reshape(b, seqlen, d_inner)
    if rmsnorm_weight is not None:
        y = gated_rms_norm(y, rmsnorm_weight, None, z=z, eps=rmsnorm_eps, group_size=d_inner // ngroups,
                           norm_before_gate=norm_before_gate)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final) if return_final_states else y


# --------------------------------------------------------------------------------------------------------------
# The gated RMSNorm


def gated_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """RMSNorm over groups of ``group_size`` channels of the last dim, times ``weight`` (+ ``bias``), gated by
    ``silu(z)`` after the norm (``norm_before_gate``) or before it; in x's dtype, computed in float32 or wider."""
    hidden = x.shape[-1]
    group_size = hidden if group_size is None else group_size
    if hidden % group_size:
        raise ValueError(f"group_size {group_size} does not divide the hidden size {hidden}")
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute)
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.to(compute))
    grouped = h.reshape(*h.shape[:-1], hidden // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = grouped.reshape(h.shape) * weight.to(compute)
    if bias is not None:
        out = out + bias.to(compute)
    if z is not None and norm_before_gate:
        out = out * F.silu(z.to(compute))
    return out.to(x.dtype)


class GatedRMSNorm(torch.nn.Module):
    """mamba_ssm's gated ``RMSNorm`` module (same constructor, parameters and ``forward(x, z=None)``)."""

    bias: torch.Tensor | None  # registered as None: Megatron's norm has no bias

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return gated_rms_norm(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate)


class ExtendedGatedRMSNorm(GatedRMSNorm):
    """The gated RMSNorm with the sharded state dict of megatron-core's ``ExtendedRMSNorm`` (weight split over TP
    on axis 0). megatron's own class cannot serve: without mamba_ssm it was derived from a MagicMock."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if not hasattr(self, "tp_group"):
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )


# --------------------------------------------------------------------------------------------------------------
# Installing into megatron-core, and the local stack spec


class MambaTorchNorm:
    """A torch LayerNorm/RMSNorm (by ``config.normalization``) with ``config.layernorm_epsilon`` unless an eps is
    given, its parameters marked ``sequence_parallel`` as Transformer Engine's norms are. Stands where the TE spec
    fuses the norm into ``in_proj`` (``MambaLayer.norm``, built without an eps in megatron-core 0.16.1) and for
    ``MambaStack``'s final norm, which megatron-core hard-codes as ``TENorm`` (0.19.2's ``has_residual`` is never
    passed there)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float | None = None) -> torch.nn.Module:  # type: ignore[misc]
        from sweeper.backends.megatron.cpu.norm import SequenceParallelTorchNorm

        return SequenceParallelTorchNorm(config, hidden_size, eps=config.layernorm_epsilon if eps is None else eps)


_TRITON_TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


def _no_triton(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} is a Triton kernel of megatron-core's dynamic-batching inference; "
                                  "Triton is not installed (training and static inference do not need it)")

    refuse.__name__ = name
    return refuse


def _provide_tensor_ops_without_triton() -> None:
    # mamba_mixer imports three Triton kernels of dynamic-batching inference at module level, and megatron-core
    # 0.16.1's module imports triton unconditionally: without Triton (CPU torch builds) the mixer would not even
    # import. (0.19.2's falls back by itself, but there megatron.core itself needs Triton to import, through
    # transformer/moe/ops/paged_stash.py, so this never applies.)
    if _TRITON_TENSOR_OPS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(_TRITON_TENSOR_OPS, "Stand-ins for megatron-core's Triton tensor ops (not installed).")
    for name in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
        setattr(stub, name, _no_triton(name))
    sys.modules[_TRITON_TENSOR_OPS] = stub
    record(_TRITON_TENSOR_OPS, stub)


def _stack_module() -> types.ModuleType:
    """The module that defines ``MambaStack``, whose ``TENorm`` builds the stack's final norm: ssm/mamba_block.py
    in megatron-core 0.16.1; models/hybrid/hybrid_block.py (as ``HybridStack``) in 0.19.2, where mamba_block.py
    only re-exports its names, so a ``TENorm`` set there would never be read."""
    from megatron.core.ssm import mamba_block

    return sys.modules[mamba_block.MambaStack.__module__]


def install() -> bool:
    """Give megatron-core's Mamba modules these torch kernels where mamba_ssm is missing (idempotent).

    Sets ``mamba_chunk_scan_combined``, ``mamba_split_conv1d_scan_combined``, ``RMSNormGated``,
    ``ExtendedRMSNorm`` and ``HAVE_MAMBA_SSM`` in ``megatron.core.ssm.mamba_mixer``, and, without Transformer
    Engine, ``MambaStack``'s final ``TENorm`` to a torch norm. Call it before the first import of
    ``megatron.core.ssm`` / ``megatron.core.models.mamba`` when Triton is absent. True when the torch kernels
    are in place, False when mamba_ssm's own kernels are (nothing changed).
    """
    with _lock:
        _provide_tensor_ops_without_triton()
        import megatron.core.ssm.mamba_mixer as mixer
        from megatron.core.extensions import transformer_engine as te_ext

        if mixer.HAVE_MAMBA_SSM and getattr(mixer, "mamba_chunk_scan_combined", None) is not mamba_chunk_scan_combined:
            return False  # mamba_ssm's own kernels
        replace(mixer, "mamba_chunk_scan_combined", mamba_chunk_scan_combined)
        replace(mixer, "mamba_split_conv1d_scan_combined", mamba_split_conv1d_scan_combined)
        replace(mixer, "RMSNormGated", GatedRMSNorm)
        replace(mixer, "ExtendedRMSNorm", ExtendedGatedRMSNorm)
        replace(mixer, "HAVE_MAMBA_SSM", True)
        if not te_ext.HAVE_TE:
            replace(_stack_module(), "TENorm", MambaTorchNorm)
        return True


def local_mamba_stack_spec(moe_grouped_gemm: bool = False) -> Any:
    """megatron-core's ``mamba_stack_spec`` (models/mamba/mamba_layer_specs.py; in 0.19.2 an alias of
    models/hybrid's ``hybrid_stack_spec``, whose GDN, DSA, MLA and MTP entries this spec leaves out) with local
    modules instead of Transformer Engine ones: each TE "layernorm + column-parallel linear" becomes a torch norm
    before a ``ColumnParallelLinear``, ``TERowParallelLinear`` a ``RowParallelLinear``, ``TEDotProductAttention``
    the local ``DotProductAttention``, and MoE layers the local MoE spec (``SequentialMLP`` experts unless
    ``moe_grouped_gemm``). Norm keys map to the TE names in checkpoints, as Megatron's local GPT spec does.
    Installs the kernels first. ``cpu.spec.adapt_local_block_spec`` applies to it for CP and SP."""
    install()
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    # num_experts only has to be set here (as in Megatron's TE mamba_stack_spec); the layer takes the config's.
    moe = get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=moe_grouped_gemm)
    stack = ModuleSpec(
        module=MambaStack,
        submodules=MambaStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=MambaTorchNorm,
                    mixer=ModuleSpec(
                        module=MambaMixer,
                        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                    ),
                    mamba_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
                ),
            ),
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=WrappedTorchNorm,
                    self_attention=ModuleSpec(
                        module=SelfAttention,
                        params={"attn_mask_type": AttnMaskType.causal},
                        submodules=SelfAttentionSubmodules(
                            linear_qkv=ColumnParallelLinear,
                            core_attention=DotProductAttention,
                            linear_proj=RowParallelLinear,
                        ),
                    ),
                    self_attn_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=WrappedTorchNorm,
                    mlp=ModuleSpec(
                        module=MLP,
                        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                    ),
                    mlp_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
                ),
            ),
            moe_layer=ModuleSpec(
                module=MoETransformerLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=WrappedTorchNorm, mlp=moe, mlp_bda=get_bias_dropout_add
                ),
            ),
        ),
    )
    record("megatron.core.models.mamba.mamba_layer_specs.mamba_stack_spec", stack)
    return stack

"""sweeper's pure-torch Mamba2 kernels (cpu/mamba.py) against a naive step-by-step recurrence, and in megatron-core.

The reference is the SSD definition run one time step at a time in float64: per head
``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``, heads sharing their group's B and C.
Outputs and gradients must match: to ~1e-12 when the kernels run in float64 (the chunked algebra is exact), and
to 1e-5 (relative to the tensor's largest value) when they run in float32, for sequence lengths that are not
multiples of the chunk size, several chunks, heads and groups. The last tests build megatron-core's own
``MambaMixer`` / ``MambaModel`` from ``local_mamba_stack_spec()`` in a fresh single-rank gloo process with both
CPU layers installed, and compare the mixer with the same computation done through the naive recurrence.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from sweeper.backends.megatron.cpu import mamba
from sweeper.backends.megatron.cpu.mamba import (
    GatedRMSNorm,
    gated_rms_norm,
    mamba_chunk_scan_combined,
    mamba_split_conv1d_scan_combined,
)

F64 = torch.float64
F32_TOL = 1e-5

# --------------------------------------------------------------------------------------------------------------
# naive references (float64, a Python loop over time steps)


def naive_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool,
             limit: tuple[float, float] | None) -> torch.Tensor:
    if dt_bias is not None:
        dt = dt + dt_bias
    if softplus:
        dt = torch.log1p(torch.exp(dt))
    if limit is not None:
        dt = torch.minimum(torch.maximum(dt, torch.tensor(limit[0], dtype=dt.dtype)),
                           torch.tensor(limit[1], dtype=dt.dtype))
    return dt


def naive_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor | None = None, z: torch.Tensor | None = None, h0: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (b,l,h,p), dt (b,l,h) already discretised, A (h), B/C (b,l,g,n), D (h) or (h,p), h0 (b,h,p,n)."""
    b, length, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    state = x.new_zeros(b, nheads, headdim, dstate) if h0 is None else h0
    outputs = []
    for t in range(length):
        y_t = []
        new_state = []
        for head in range(nheads):
            group = head // (nheads // ngroups)
            decay = torch.exp(dt[:, t, head] * A[head])[:, None, None]
            inp = dt[:, t, head][:, None, None] * x[:, t, head][:, :, None] * B[:, t, group][:, None, :]
            s = decay * state[:, head] + inp
            new_state.append(s)
            y = (s * C[:, t, group][:, None, :]).sum(-1)
            if D is not None:
                y = y + (D[head] if D.dim() == 1 else D[head][None, :]) * x[:, t, head]
            y_t.append(y)
        state = torch.stack(new_state, dim=1)
        outputs.append(torch.stack(y_t, dim=1))
    y = torch.stack(outputs, dim=1)
    if z is not None:
        y = y * z * torch.sigmoid(z)
    return y, state


def naive_gated_norm(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, eps: float, group_size: int,
                     norm_before_gate: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    gate = None if z is None else z * torch.sigmoid(z)
    if gate is not None and not norm_before_gate:
        x = x * gate
    pieces = []
    for start in range(0, x.shape[-1], group_size):
        part = x[..., start:start + group_size]
        pieces.append(part / torch.sqrt((part * part).sum(-1, keepdim=True) / group_size + eps))
    out = torch.cat(pieces, dim=-1) * weight
    if bias is not None:
        out = out + bias
    if gate is not None and norm_before_gate:
        out = out * gate
    return out


def naive_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (b,l,d), weight (d,w): out_t = bias + sum_k w_k x_{t-w+1+k}, then silu."""
    width = weight.shape[1]
    out = torch.zeros_like(x) if bias is None else bias.expand_as(x).clone()
    for k in range(width):
        shift = width - 1 - k
        shifted = F.pad(x, (0, 0, shift, 0))[:, : x.shape[1]]
        out = out + shifted * weight[:, k]
    return out * torch.sigmoid(out)


# --------------------------------------------------------------------------------------------------------------
# comparison helpers


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.to(F64) - expected).abs().max() / expected.abs().max().clamp(min=1.0)).item()


def grads(out: torch.Tensor | tuple[torch.Tensor, ...], inputs: list[torch.Tensor],
          seed: int = 7) -> list[torch.Tensor]:
    """Gradients of a fixed random projection of the output(s) (the same for kernel and reference)."""
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.to(F64) * torch.randn(o.shape, generator=gen, dtype=F64)).sum() for o in outs)
    return list(torch.autograd.grad(loss, inputs))


def check(actual_out: Any, expected_out: Any, actual_grads: list[torch.Tensor], expected_grads: list[torch.Tensor],
          tol: float, names: list[str]) -> float:
    worst = 0.0
    pairs = list(zip(actual_out if isinstance(actual_out, tuple) else (actual_out,),
                     expected_out if isinstance(expected_out, tuple) else (expected_out,)))
    pairs += list(zip(actual_grads, expected_grads))
    labels = [f"output{i}" for i in range(len(pairs) - len(names))] + [f"grad {n}" for n in names]
    for label, (a, e) in zip(labels, pairs):
        assert a.shape == e.shape, (label, a.shape, e.shape)
        err = rel_err(a, e)
        assert err <= tol, f"{label}: relative error {err:.3g} > {tol:g}"
        worst = max(worst, err)
    return worst


def leaves(dtype: torch.dtype, *tensors: torch.Tensor | None) -> list[Any]:
    return [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in tensors]


# --------------------------------------------------------------------------------------------------------------
# mamba_chunk_scan_combined

SCAN_CASES = [
    # (seqlen, chunk, nheads, ngroups, D kind, z, dt_bias, softplus, dt_limit, initial state)
    pytest.param(37, 8, 6, 3, "head", True, True, True, None, False, id="l37-c8-h6g3-D-z-bias"),
    pytest.param(40, 8, 4, 2, "hdim", False, True, True, None, True, id="l40-c8-exact-chunks-Dhdim-h0"),
    pytest.param(33, 16, 4, 1, None, True, False, True, (0.05, 0.6), True, id="l33-c16-g1-limit-h0"),
    pytest.param(5, 64, 2, 2, "head", False, True, True, None, False, id="short-seq-long-chunk"),
    pytest.param(29, 4, 8, 4, "head", True, True, False, None, True, id="l29-c4-many-chunks-no-softplus"),
]


def _scan_inputs(seqlen: int, nheads: int, ngroups: int, d_kind: str | None, with_z: bool, with_bias: bool,
                 with_h0: bool, softplus: bool, seed: int = 0) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    b, p, n = 2, 4, 5

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64) * scale

    # Without softplus dt is used as given: keep it positive, as a discretisation step is.
    dt = rnd(b, seqlen, nheads) if softplus else torch.rand(b, seqlen, nheads, generator=gen, dtype=F64) * 0.5
    return {
        "x": rnd(b, seqlen, nheads, p),
        "dt": dt,
        "A": -torch.rand(nheads, generator=gen, dtype=F64) * 3 - 0.1,
        "B": rnd(b, seqlen, ngroups, n),
        "C": rnd(b, seqlen, ngroups, n),
        "D": None if d_kind is None else rnd(nheads) if d_kind == "head" else rnd(nheads, p),
        "z": rnd(b, seqlen, nheads, p) if with_z else None,
        "dt_bias": rnd(nheads, scale=0.5) if with_bias else None,
        "h0": rnd(b, nheads, p, n) if with_h0 else None,
    }


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-10), (torch.float32, F32_TOL)], ids=["f64", "f32"])
@pytest.mark.parametrize("seqlen,chunk,nheads,ngroups,d_kind,with_z,with_bias,softplus,limit,with_h0", SCAN_CASES)
def test_chunk_scan_matches_recurrence(dtype: torch.dtype, tol: float, seqlen: int, chunk: int, nheads: int,
                                       ngroups: int, d_kind: str | None, with_z: bool, with_bias: bool,
                                       softplus: bool, limit: tuple[float, float] | None, with_h0: bool) -> None:
    raw = _scan_inputs(seqlen, nheads, ngroups, d_kind, with_z, with_bias, with_h0, softplus)
    names = [k for k, v in raw.items() if v is not None]
    ours = dict(zip(raw, leaves(dtype, *raw.values())))
    ref = dict(zip(raw, leaves(F64, *raw.values())))
    kwargs: dict[str, Any] = {"dt_limit": limit} if limit is not None else {}
    out = mamba_chunk_scan_combined(
        ours["x"], ours["dt"], ours["A"], ours["B"], ours["C"], chunk, D=ours["D"], z=ours["z"],
        dt_bias=ours["dt_bias"], initial_states=ours["h0"], dt_softplus=softplus, return_final_states=True,
        **kwargs)
    assert out[0].dtype == dtype and out[0].shape == raw["x"].shape
    expected = naive_scan(ref["x"], naive_dt(ref["dt"], ref["dt_bias"], softplus, limit), ref["A"], ref["B"],
                          ref["C"], D=ref["D"], z=ref["z"], h0=ref["h0"])
    check(out, expected, grads(out, [ours[k] for k in names]), grads(expected, [ref[k] for k in names]), tol, names)


def test_chunk_size_does_not_change_the_result() -> None:
    raw = _scan_inputs(45, 4, 2, "head", True, True, True, True, seed=3)
    results = []
    for chunk in (1, 3, 8, 16, 45, 128):
        x, dt, A, B, C, D, z, bias, h0 = leaves(torch.float32, *raw.values())
        out = mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=bias, initial_states=h0,
                                        dt_softplus=True, return_final_states=True)
        results.append((out, grads(out, [x, dt, A, B, C, D, z, bias, h0])))
    (ref_out, ref_grads), *rest = results
    for out, g in rest:
        check(out, tuple(o.to(F64) for o in ref_out), g, [t.to(F64) for t in ref_grads], F32_TOL,
              ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "h0"])


def test_return_values_follow_the_flags() -> None:
    raw = _scan_inputs(10, 2, 1, None, False, False, False, True)
    y = mamba_chunk_scan_combined(raw["x"], raw["dt"], raw["A"], raw["B"], raw["C"], 4)
    assert isinstance(y, torch.Tensor) and y.shape == raw["x"].shape
    y2, final = mamba_chunk_scan_combined(raw["x"], raw["dt"], raw["A"], raw["B"], raw["C"], 4,
                                          return_final_states=True)
    assert torch.equal(y, y2) and final.shape == (2, 2, 4, 5)
    # A bfloat16 input comes back in bfloat16, computed in float32 inside.
    yb = mamba_chunk_scan_combined(raw["x"].bfloat16(), raw["dt"].bfloat16(), raw["A"].float(),
                                   raw["B"].bfloat16(), raw["C"].bfloat16(), 4)
    assert yb.dtype == torch.bfloat16 and rel_err(yb, y) < 5e-2


@pytest.mark.parametrize("kwargs", [
    {"seq_idx": torch.zeros(2, 10, dtype=torch.int32)},
    {"cu_seqlens": torch.tensor([0, 10])},
    {"return_varlen_states": True},
    {"chunk_indices": torch.zeros(1, dtype=torch.int32)},
], ids=["seq_idx", "cu_seqlens", "varlen_states", "chunk_indices"])
def test_packed_sequences_are_refused(kwargs: dict[str, Any]) -> None:
    raw = _scan_inputs(10, 2, 1, None, False, False, False, True)
    with pytest.raises(NotImplementedError, match="not support"):
        mamba_chunk_scan_combined(raw["x"], raw["dt"], raw["A"], raw["B"], raw["C"], 4, **kwargs)


def test_bad_shapes_name_the_sizes() -> None:
    raw = _scan_inputs(10, 4, 2, None, False, False, False, True)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        mamba_chunk_scan_combined(raw["x"], raw["dt"], raw["A"][:3], raw["B"], raw["C"], 4)
    with pytest.raises(ValueError, match=r"multiple of ngroups \(3\)"):
        B = torch.randn(2, 10, 3, 5, dtype=F64)
        mamba_chunk_scan_combined(raw["x"], raw["dt"], raw["A"], B, B, 4)


# --------------------------------------------------------------------------------------------------------------
# the gated RMSNorm


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-10), (torch.float32, F32_TOL)], ids=["f64", "f32"])
@pytest.mark.parametrize("norm_before_gate", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("group_size,with_z", [(None, True), (8, True), (4, False)], ids=["whole", "g8", "g4-noz"])
def test_gated_rms_norm_matches_formula(dtype: torch.dtype, tol: float, norm_before_gate: bool,
                                        group_size: int | None, with_z: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x, z, w, bias = (torch.randn(*s, generator=gen, dtype=F64) for s in ((3, 5, 24), (3, 5, 24), (24,), (24,)))
    eps = 1e-5
    x_, z_, w_ = leaves(dtype, x, z if with_z else None, w)
    xr, zr, wr = leaves(F64, x, z if with_z else None, w)
    norm = GatedRMSNorm(24, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate, dtype=dtype)
    assert torch.equal(norm.weight, torch.ones(24, dtype=dtype)) and norm.bias is None
    with torch.no_grad():
        norm.weight.copy_(w_)
    out = norm(x_, z_)
    assert out.dtype == dtype
    expected = naive_gated_norm(xr, wr, zr, eps, group_size or 24, norm_before_gate)
    names = ["x", "weight"] + (["z"] if with_z else [])
    check(out, expected, grads(out, [x_, norm.weight] + ([z_] if with_z else [])),
          grads(expected, [xr, wr] + ([zr] if with_z else [])), tol, names)
    # The functional form takes a bias too (mamba_ssm's signature), added after the weight, before a late gate.
    with_bias = gated_rms_norm(xr, wr, bias, z=zr, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
    assert rel_err(with_bias, naive_gated_norm(xr, wr, zr, eps, group_size or 24, norm_before_gate, bias)) < 1e-12


# --------------------------------------------------------------------------------------------------------------
# mamba_split_conv1d_scan_combined


def _split_inputs(seqlen: int, nheads: int, headdim: int, ngroups: int, dstate: int, d_kind: str,
                  width: int = 4, d_model: int = 12, seed: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    d_inner = nheads * headdim
    conv_dim = d_inner + 2 * ngroups * dstate

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64) * scale

    return {
        "zxbcdt": rnd(2, seqlen, d_inner + conv_dim + nheads),
        "conv_w": rnd(conv_dim, width, scale=0.5),
        "conv_b": rnd(conv_dim, scale=0.1),
        "dt_bias": rnd(nheads, scale=0.5),
        "A": -torch.rand(nheads, generator=gen, dtype=F64) * 3 - 0.1,
        "D": rnd(nheads) if d_kind == "head" else rnd(nheads, headdim),
        "norm_w": 1 + rnd(d_inner, scale=0.1),
        "out_w": rnd(d_model, d_inner, scale=0.2),
        "out_b": rnd(d_model, scale=0.1),
    }


def _naive_split(t: dict[str, torch.Tensor], nheads: int, headdim: int, ngroups: int, dstate: int, norm: bool,
                 norm_before_gate: bool, outproj: bool, eps: float) -> torch.Tensor:
    b, seqlen = t["zxbcdt"].shape[:2]
    d_inner = nheads * headdim
    z, xBC, dt = torch.split(t["zxbcdt"], [d_inner, d_inner + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = naive_causal_conv(xBC, t["conv_w"], t["conv_b"])
    x, B, C = torch.split(xBC, [d_inner, ngroups * dstate, ngroups * dstate], dim=-1)
    z4 = z.reshape(b, seqlen, nheads, headdim)
    y, _ = naive_scan(x.reshape(b, seqlen, nheads, headdim), naive_dt(dt, t["dt_bias"], True, None), t["A"],
                      B.reshape(b, seqlen, ngroups, dstate), C.reshape(b, seqlen, ngroups, dstate), D=t["D"],
                      z=None if norm else z4)
    y = y.reshape(b, seqlen, d_inner)
    if norm:
        y = naive_gated_norm(y, t["norm_w"], z, eps, d_inner // ngroups, norm_before_gate)
    if outproj:
        y = y @ t["out_w"].T + t["out_b"]
    return y


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-10), (torch.float32, F32_TOL)], ids=["f64", "f32"])
@pytest.mark.parametrize("d_kind,norm,norm_before_gate,outproj", [
    ("head", False, False, False),  # what Megatron's mixer calls: z gating inside, its own norm after
    ("hdim", False, False, False),  # D_has_hdim: D (h, p), headdim implied
    ("head", True, False, True),
    ("head", True, True, False),
], ids=["mixer-call", "mixer-call-Dhdim", "norm-gate-first+outproj", "norm-first"])
def test_split_conv1d_scan_matches_recurrence(dtype: torch.dtype, tol: float, d_kind: str, norm: bool,
                                              norm_before_gate: bool, outproj: bool) -> None:
    nheads, headdim, ngroups, dstate, chunk = 6, 4, 2, 3, 8
    raw = _split_inputs(27, nheads, headdim, ngroups, dstate, d_kind)
    ours = dict(zip(raw, leaves(dtype, *raw.values())))
    ref = dict(zip(raw, leaves(F64, *raw.values())))
    out = mamba_split_conv1d_scan_combined(
        ours["zxbcdt"], ours["conv_w"], ours["conv_b"], ours["dt_bias"], ours["A"], ours["D"], chunk,
        activation="silu", headdim=headdim if d_kind == "head" else None, ngroups=ngroups,
        norm_before_gate=norm_before_gate,
        rmsnorm_weight=ours["norm_w"] if norm else None, rmsnorm_eps=1e-5,
        outproj_weight=ours["out_w"] if outproj else None, outproj_bias=ours["out_b"] if outproj else None)
    expected = _naive_split(ref, nheads, headdim, ngroups, dstate, norm, norm_before_gate, outproj, 1e-5)
    names = ["zxbcdt", "conv_w", "conv_b", "dt_bias", "A", "D"] + (["norm_w"] if norm else [])
    names += ["out_w", "out_b"] if outproj else []
    check(out, expected, grads(out, [ours[k] for k in names]), grads(expected, [ref[k] for k in names]), tol, names)


def test_split_conv1d_scan_final_state_and_refusals() -> None:
    raw = _split_inputs(9, 2, 4, 1, 3, "head")
    args = (raw["zxbcdt"], raw["conv_w"], raw["conv_b"], raw["dt_bias"], raw["A"], raw["D"], 4)
    y, final = mamba_split_conv1d_scan_combined(*args, headdim=4, return_final_states=True)
    assert y.shape == (2, 9, 8) and final.shape == (2, 2, 4, 3)
    with pytest.raises(NotImplementedError, match="seq_idx"):
        mamba_split_conv1d_scan_combined(*args, headdim=4, seq_idx=torch.zeros(2, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match="headdim is required"):
        mamba_split_conv1d_scan_combined(*args)
    with pytest.raises(NotImplementedError, match="non-SSM MLP branch"):
        wider = F.pad(raw["zxbcdt"], (0, 4))
        mamba_split_conv1d_scan_combined(wider, *args[1:], headdim=4)


# --------------------------------------------------------------------------------------------------------------
# megatron-core's MambaMixer and MambaModel with install() (in a fresh single-rank process)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _conv1d(mixer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixer's depthwise conv weight (d, 1, w) and bias: an ``nn.Conv1d`` in megatron-core 0.16.1, two
    parameters (``conv1d_weight``, ``conv1d_bias``) in 0.19.2."""
    if hasattr(mixer, "conv1d_weight"):
        return mixer.conv1d_weight, mixer.conv1d_bias
    return mixer.conv1d.weight, mixer.conv1d.bias


def _naive_mixer(mixer: Any, hidden: torch.Tensor) -> torch.Tensor:
    """MambaMixer.forward recomputed through the naive recurrence (float64), with the mixer's own parameters."""
    d_inner, heads, groups, n, p = (mixer.d_inner_local_tp, mixer.nheads_local_tp, mixer.ngroups_local_tp,
                                    mixer.d_state, mixer.headdim)
    zxbcdt = F.linear(hidden.to(F64), mixer.in_proj.weight.to(F64)).transpose(0, 1)  # (b, l, d)
    b, seqlen = zxbcdt.shape[:2]
    z, xBC, dt = torch.split(zxbcdt, [d_inner, d_inner + 2 * groups * n, heads], dim=-1)
    conv_weight, conv_bias = _conv1d(mixer)
    xBC = naive_causal_conv(xBC, conv_weight[:, 0].to(F64), conv_bias.to(F64))
    x, B, C = torch.split(xBC, [d_inner, groups * n, groups * n], dim=-1)
    D = mixer.D.to(F64)
    y, _ = naive_scan(x.reshape(b, seqlen, heads, p), naive_dt(dt, mixer.dt_bias.to(F64), True, None),
                      -torch.exp(mixer.A_log.to(F64)), B.reshape(b, seqlen, groups, n),
                      C.reshape(b, seqlen, groups, n), D=D.reshape(heads, p) if mixer.D_has_hdim else D,
                      z=z.reshape(b, seqlen, heads, p))
    y = y.reshape(b, seqlen, d_inner)
    if mixer.rmsnorm:
        y = naive_gated_norm(y, mixer.norm.weight.to(F64), None, mixer.norm.eps, d_inner // groups, False)
    return F.linear(y.transpose(0, 1), mixer.out_proj.weight.to(F64))


def _megatron_checks(port: int) -> dict[str, Any]:
    import copy

    from sweeper.backends.megatron.cpu import compat

    compat.install()
    assert mamba.install() is True
    assert mamba.install() is True  # idempotent
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    import megatron.core.ssm.mamba_mixer as mixer_module
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    report: dict[str, Any] = {"kernels": mixer_module.mamba_split_conv1d_scan_combined.__module__}
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        config = TransformerConfig(
            num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, mamba_state_dim=8,
            mamba_head_dim=8, mamba_num_groups=2, use_cpu_initialization=True, hidden_dropout=0.0,
            attention_dropout=0.0, normalization="RMSNorm", layernorm_epsilon=1e-6,
            num_moe_experts=2, moe_router_topk=1, moe_router_pre_softmax=True, moe_token_dispatcher_type="allgather",
            moe_ffn_hidden_size=32, add_bias_linear=False,
        )
        spec = mamba.local_mamba_stack_spec()
        seqlen, batch = 37, 2
        hidden = torch.randn(seqlen, batch, 32)
        errors: dict[str, float] = {}
        for D_has_hdim, rmsnorm in ((False, True), (True, True), (False, False)):
            layer_spec = copy.deepcopy(spec.submodules.mamba_layer)
            layer_spec.submodules.mixer.params = {"D_has_hdim": D_has_hdim, "rmsnorm": rmsnorm, "chunk_size": 16}
            layer = build_module(layer_spec, config=config, layer_number=1, pg_collection=pgs)
            mixer = layer.mixer
            # Non-trivial values for the parameters that start at ones/zeros.
            with torch.no_grad():
                mixer.D.uniform_(-1, 1)
                _conv1d(mixer)[1].uniform_(-0.2, 0.2)
                if rmsnorm:
                    mixer.norm.weight.uniform_(0.5, 1.5)
            params = [p for p in mixer.parameters()]
            key = f"hdim={D_has_hdim},norm={rmsnorm}"

            expected = _naive_mixer(mixer, hidden)
            expected_grads = grads(expected, params)
            runs = {}
            for mem_eff, chunk in ((True, 16), (False, 16), (True, 128), (True, 5)):
                mixer.use_mem_eff_path, mixer.chunk_size = mem_eff, chunk
                out, bias = mixer(hidden)
                assert bias is None and out.shape == hidden.shape and out.dtype == torch.float32
                runs[(mem_eff, chunk)] = out
                g = grads(out, params)
                assert all(torch.isfinite(t).all() for t in g)
                errors[f"{key} mem_eff={mem_eff} chunk={chunk}"] = check(
                    out, expected, g, expected_grads, F32_TOL, [n for n, _ in mixer.named_parameters()])
            errors[f"{key} paths"] = rel_err(runs[(True, 16)], runs[(False, 16)].to(F64))
            # The whole MambaLayer (torch norm, residual) runs forward and backward.
            layer_out = layer(hidden.requires_grad_(True))
            layer_out.sum().backward()
            assert torch.isfinite(hidden.grad).all() and layer_out.shape == hidden.shape
            hidden = hidden.detach()
            report.setdefault("norm_eps", layer.norm.eps)

        # A hybrid MambaModel (mamba, attention, MLP, MoE layers) from the local stack spec: loss and backward.
        model = MambaModel(config=config, mamba_stack_spec=spec, vocab_size=64, max_sequence_length=seqlen,
                           hybrid_override_pattern="M*-E", pg_collection=pgs)
        tokens = torch.randint(0, 64, (batch, seqlen))
        position_ids = torch.arange(seqlen).expand(batch, seqlen)
        loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        report["layers"] = [type(layer).__name__ for layer in model.decoder.layers]
        report["final_norm"] = type(model.decoder.final_norm).__name__
        report["loss"] = loss.item()
        report["grads_finite"] = all(torch.isfinite(p.grad).all().item()
                                     for p in model.parameters() if p.grad is not None)
        report["grads_missing"] = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        report["sharded_keys"] = sorted(getattr(v, "key", k) for k, v in model.sharded_state_dict().items()
                                        if "layers.0." in k)
        report["errors"] = errors
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    return report


def _worker(port: int, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        out.put(("ok", _megatron_checks(port)))
    except BaseException as exc:  # noqa: BLE001 - handed to the test, which fails with it
        import traceback

        out.put(("error", traceback.format_exc(limit=12) + repr(exc)))


@pytest.fixture(scope="module")
def megatron_report() -> dict[str, Any]:
    # A fresh process: compat.install() redirects CUDA for the whole process, which other tests must not see.
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(_free_port(), out))
    proc.start()
    try:
        status, payload = out.get(timeout=150)
    except queue.Empty:
        pytest.fail("the megatron-core Mamba process did not answer within 150 s")
    finally:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", payload
    return payload


def test_megatron_mixer_matches_naive_recurrence(megatron_report: dict[str, Any]) -> None:
    assert megatron_report["kernels"] == mamba.__name__
    errors = megatron_report["errors"]
    # Both training paths (fused split-conv-scan, and conv + chunk scan + gated norm), several chunk sizes
    # (37 tokens: 3 chunks of 16, one of 128, 8 of 5), D per head and per channel, with and without the norm.
    assert len(errors) == 15
    assert max(errors.values()) <= F32_TOL, errors


def test_megatron_hybrid_model_trains_with_local_spec(megatron_report: dict[str, Any]) -> None:
    assert megatron_report["layers"] == ["MambaLayer", "TransformerLayer", "MLPLayer", "MoETransformerLayer"]
    assert megatron_report["final_norm"] == "RMSNorm"
    assert megatron_report["norm_eps"] == 1e-6  # the config's epsilon, as TE's fused norm would use
    assert torch.isfinite(torch.tensor(megatron_report["loss"]))
    assert megatron_report["grads_finite"] and megatron_report["grads_missing"] == []
    keys = megatron_report["sharded_keys"]
    assert "decoder.layers.0.mixer.in_proj.layer_norm_weight" in keys  # TE's name for the fused norm
    assert "decoder.layers.0.mixer.norm.weight" in keys

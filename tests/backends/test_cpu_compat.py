"""The CPU compatibility mode's BF16/FP16 products: computed in FP32 from the low-precision inputs and rounded back
(a tensor-core GEMM's arithmetic), forward and backward, including inside a custom autograd function's backward as
Megatron's linear layers have. Each check runs in its own thread: the mode is entered per thread and stays."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("megatron.core")

_ATEN_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                  torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
                  torch.ops.aten.convolution_backward.default}


class _KernelDtypes(TorchDispatchMode):
    """Counts the dtypes the product kernels receive (the dispatcher's view, below autograd and the function mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _ATEN_PRODUCTS:
            self.seen[str(next(a.dtype for a in args if isinstance(a, torch.Tensor)))] += 1
        return func(*args, **(kwargs or {}))


def _in_mode_thread(fn: Callable[[], Any], counter: _KernelDtypes | None = None) -> Any:
    """``fn()`` in a new thread under the CPU mode (and ``counter``, entered first: a dispatch mode entered inside
    a torch function mode hides the calls from it); its result or its exception."""
    box: dict[str, Any] = {}

    def main() -> None:
        from sweeper.backends.megatron.cpu import compat

        try:
            with counter or contextlib.nullcontext():
                assert compat.install()
                box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box["exc"] = exc

    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
    if "exc" in box:
        raise box["exc"]
    return box["out"]


def _products(x: torch.Tensor, w: torch.Tensor, conv_w: torch.Tensor) -> list[torch.Tensor]:
    q = x.reshape(4, 8, 16)
    return [
        torch.matmul(x, w.t()),
        x @ w.t(),
        torch.nn.functional.linear(x, w),
        torch.bmm(q, q.transpose(1, 2)),
        torch.baddbmm(torch.zeros(4, 8, 8, dtype=x.dtype), q, q.transpose(1, 2), beta=0.0, alpha=0.25),
        torch.einsum("bij,bkj->bik", q, q),
        torch.nn.functional.conv1d(x.t().unsqueeze(0), conv_w, padding=3, groups=16),
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_products_are_fp32_products_rounded_back(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x32, w32 = torch.randn(32, 16, generator=gen), torch.randn(24, 16, generator=gen)
    conv32 = torch.randn(16, 1, 4, generator=gen)
    x, w, conv = x32.to(dtype), w32.to(dtype), conv32.to(dtype)
    expected = [p.to(dtype) for p in _products(x.float(), w.float(), conv.float())]
    native = _products(x, w, conv)  # torch's own low-precision kernels, outside the mode

    got = _in_mode_thread(lambda: _products(x, w, conv))
    counter = _KernelDtypes()  # a second pass seen from the dispatcher (its decompositions may sum differently)
    _in_mode_thread(lambda: _products(x, w, conv), counter)
    seen = counter.seen
    for g, e, n in zip(got, expected, native, strict=True):
        assert g.dtype == dtype and g.shape == e.shape
        # The FP32 product rounded once (to one unit in the last place: the mode runs in another thread, whose
        # OpenMP team may split the FP32 sum differently).
        assert torch.allclose(g.float(), e.float(), rtol=torch.finfo(dtype).eps, atol=0), (g - e).abs().max()
        assert torch.allclose(g.float(), n.float(), rtol=2e-2, atol=2e-2)  # and torch's kernel up to its rounding
    assert set(seen) == {"torch.float32"}, seen  # no low-precision product reached a kernel


class _Linear(torch.autograd.Function):
    """A linear layer written as Megatron writes its own: products called in forward and in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad.matmul(w), grad.t().matmul(x)


def test_backward_products_run_in_fp32_and_gradients_keep_their_type() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(24, 16, generator=gen).bfloat16().requires_grad_()
    q = torch.randn(4, 8, 16, generator=gen).bfloat16().requires_grad_()

    def run() -> list[torch.Tensor]:
        loss = _Linear.apply(x, w).float().square().sum() + torch.bmm(q, q.transpose(1, 2)).float().sum()
        # As Megatron's schedules call it (custom_backward): the engine directly, so the mode stays active.
        # (Tensor.backward is itself a torch function: the mode is popped while it runs.)
        torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
            tensors=(loss,), grad_tensors=(torch.ones_like(loss),), keep_graph=False, create_graph=False,
            inputs=(), allow_unreachable=True, accumulate_grad=True)
        return [x.grad, w.grad, q.grad]

    counter = _KernelDtypes()
    grads = _in_mode_thread(run, counter)
    assert set(counter.seen) == {"torch.float32"}, counter.seen
    assert all(g is not None and g.dtype == torch.bfloat16 for g in grads)
    # The custom function's gradients: the FP32 products of the same BF16 tensors, rounded once.
    grad_out = (2 * torch.matmul(x.detach().float(), w.detach().float().t()).bfloat16().float()).bfloat16()
    eps = torch.finfo(torch.bfloat16).eps
    assert torch.allclose(grads[0].float(), (grad_out.float() @ w.detach().float()).bfloat16().float(), rtol=eps)
    assert torch.allclose(grads[1].float(), (grad_out.float().t() @ x.detach().float()).bfloat16().float(), rtol=eps)


def test_megatrons_compiled_fusions_run_eager_on_a_cpu_rank() -> None:
    from megatron.core.activations import quick_gelu  # decorated with jit_fuser (torch.compile) at import
    from torch._dynamo.utils import counters

    x = torch.randn(16)
    before = dict(counters["frames"])
    out = _in_mode_thread(lambda: quick_gelu(x))
    assert dict(counters["frames"]) == before  # Dynamo traced nothing: no compile, no host C++ compiler needed
    assert torch.allclose(out, x * torch.sigmoid(1.702 * x))


def test_megatrons_linear_backward_runs_its_products_in_fp32_even_with_the_mode_popped() -> None:
    """torch.autograd.backward is itself a torch function, so the mode is off while it runs (Megatron's activation
    recompute calls it): the linear layers' backward keeps its products in FP32 all the same."""
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Linear

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 2, 16, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(24, 16, generator=gen).bfloat16().requires_grad_()

    def run() -> list[torch.Tensor]:
        # No gradient-accumulation fusion, no TP all-reduce or sequence parallelism: no process group needed.
        # megatron-core 0.19 adds gtp_remat_size (1: the weight is whole).
        gtp = (1,) if "gtp_remat_size" in inspect.signature(Linear.forward).parameters else ()
        out = Linear.apply(x, w, None, False, False, False, None, 0, None, *gtp)
        torch.autograd.backward(out.float().square().sum())
        return [x.grad, w.grad]

    counter = _KernelDtypes()
    grads = _in_mode_thread(run, counter)
    assert set(counter.seen) == {"torch.float32"}, counter.seen
    assert all(g is not None and g.dtype == torch.bfloat16 for g in grads)


def test_mixed_types_keep_torchs_own_verdict() -> None:
    x, w = torch.randn(4, 8).bfloat16(), torch.randn(8, 3)

    def run() -> None:
        torch.matmul(x, w)  # BF16 @ FP32: torch refuses it, on a GPU too; upcasting both would hide that

    with pytest.raises(RuntimeError, match="dtype"):
        _in_mode_thread(run)

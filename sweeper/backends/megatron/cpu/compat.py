"""Run megatron-core on a CPU-only torch build by redirecting its hard-coded CUDA calls to the CPU.

megatron-core 0.16 assumes a GPU in ~190 places (``torch.cuda.current_device()`` as allocation device,
CUDA RNG states, streams and events, ``param.type() == 'torch.cuda.FloatTensor'``). Rather than patching each
call site, ``install()`` makes a few generic redirections (see docs/MEGATRON_ON_CPU.md): a
``TorchFunctionMode`` that turns every CUDA device argument into the CPU, an RNG tracker that keeps CPU generator
states, and no-op stand-ins for the stream/event API. Idempotent.

How each CUDA assumption listed in docs/MEGATRON_ON_CPU.md is met: allocations on ``torch.cuda.current_device()``
(GlobalMemoryBuffer, DDP's param/grad buffers, tensor-parallel mappings) get the CPU device from the patched
``current_device``; literal ``device="cuda"`` factories, ``Tensor.cuda()``/``.to("cuda")`` and the optimizer's
``param.type()`` checks go through the mode; RNG forks and activation recompute use CPU generator states;
``te_general_gemm`` is defined as None and MLA's Transformer Engine branch is switched off (its duplicated
``TELinear`` becomes cpu.linear's ``DuplicatedLinear``); the MoE alltoall
dispatcher gets host split sizes as numpy arrays and uneven all-gathers (``_patch_alltoall_dispatcher``);
Megatron-FSDP's constructor gets a device index to format (``_patch_megatron_fsdp``); BF16/FP16 products run in FP32
and are rounded back, as a tensor-core GEMM does, at FP32's speed (``_PRODUCTS``); Megatron's torch.compile'd
fusions run eager (``_run_eager``).

Two of these are megatron-core's own bugs without Transformer Engine, whatever the device: ``te_general_gemm``
undefined in the router (NameError at the first MoE forward: seen on an H200 without TE) and TE's MagicMock classes
in multi-latent attention and the Megatron-FSDP adapter. ``install()`` mends those on a GPU rank without TE too
(``_patch_megatron_without_te``); everything else here is the CPU's and stays off where CUDA is available.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from sweeper.backends.megatron.cpu.patches import replace

_installed = False
_without_te_patched = False
_mode_entered = threading.local()  # per thread (an ident set would be fooled by a later thread reusing an ident)
_lock = threading.Lock()
_CPU = torch.device("cpu")


def install() -> bool:
    """Install the redirections (once per process, the device mode once per thread); True when the CPU ones are
    active. On a CUDA device only megatron-core's own fixes for a missing Transformer Engine are made."""
    global _installed, _without_te_patched
    cuda = torch.cuda.is_available()
    with _lock:
        if not _without_te_patched:
            _patch_megatron_without_te()
            _without_te_patched = True
        if cuda:
            return False
        if not _installed:
            _patch_torch_cuda()
            _patch_megatron()
            _installed = True
        # Torch function modes (and Dynamo's flags) are thread-local; set for the life of the thread that runs the
        # smoke run.
        if not getattr(_mode_entered, "done", False):
            _CudaToCpuMode().__enter__()
            _run_eager()
            _mode_entered.done = True
    return True


def _is_cuda(device: Any) -> bool:
    # An int device means "CUDA device N" to torch factories.
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


# The tensor methods the mode rewrites whatever their keyword arguments.
_TENSOR_METHODS = frozenset({torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to, torch.Tensor.pin_memory})

# The products and convolutions a BF16 or FP16 layout runs: on a GPU, tensor-core GEMMs that accumulate in FP32 and
# round their output to the input's type. A CPU without BF16 instructions (AVX512-BF16 / AMX) runs them 18-25x
# slower than in FP32 (this machine: a 256x64 @ 64x1344 linear 14.1 ms against 0.76 ms, a depthwise conv1d 5.1 ms
# against 0.2 ms), which made a BF16 proxy step 2.5x an FP32 one. The mode computes them in FP32 from the same
# low-precision inputs and rounds the result back: the GPU's arithmetic, at FP32's speed. Backward passes get it
# too: autograd differentiates the FP32 product, and Megatron's own autograd functions (its linear layers, sweeper's
# grouped experts) call these products in their backward while the mode is active.
_PRODUCTS = frozenset({
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
    torch.addmm, torch.baddbmm, torch.Tensor.baddbmm, torch.einsum, torch.nn.functional.linear, torch.conv1d,
    torch.nn.functional.conv1d,
})
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class _ProductsInFp32(TorchFunctionMode):
    """``_PRODUCTS`` in FP32 and nothing else: for an autograd function's backward that runs while the main mode
    is popped (``torch.autograd.backward`` is a torch function, so the mode is off while it runs; Megatron's
    activation recompute calls it, and the recomputed layer's linear layers then run their backward products in BF16:
    a one-rank DeepSeek proxy step with full recompute took 4.0 s against 2.1 s in FP32)."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in _PRODUCTS:
            return _in_fp32(func, args, kwargs)
        return func(*args, **(kwargs or {}))


def products_in_fp32_on_backward(function: type[torch.autograd.Function]) -> None:
    """Run ``function``'s (an autograd Function's) backward under ``_ProductsInFp32``."""
    backward = function.backward

    def wrapped(ctx: Any, *grads: Any) -> Any:
        with _ProductsInFp32():
            return backward(ctx, *grads)

    replace(function, "backward", staticmethod(wrapped))


def _in_fp32(func: Callable[..., Any], args: tuple, kwargs: dict[str, Any] | None) -> Any:
    """``func`` on FP32 copies of its tensor arguments when all are of one low precision, its output rounded back;
    as is otherwise (mixed types keep torch's own verdict, an error included, as on a GPU)."""
    flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else (x,))]
    dtypes = {a.dtype for a in flat if isinstance(a, torch.Tensor)}
    low = next(iter(dtypes)) if len(dtypes) == 1 else None
    if low not in _LOW_PRECISION or (kwargs and "out" in kwargs):
        return func(*args, **(kwargs or {}))

    def up(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype == low:
            return x.float()
        if isinstance(x, (list, tuple)):
            return type(x)(up(y) for y in x)
        return x

    out = func(*up(args), **(kwargs or {}))
    return out.to(low) if isinstance(out, torch.Tensor) and out.dtype == torch.float32 else out


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in every torch call (the mechanism torch.set_default_device uses)."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func in _PRODUCTS:
            return _in_fp32(func, args, kwargs)
        if not kwargs and func not in _TENSOR_METHODS:
            # Nearly every call: no device to rewrite. The mode sees every torch operator a CPU rank runs, so this
            # path stays short (issue 31: a one-rank Nemotron proxy step 5.4 -> 5.3 s, the dict copy it skips).
            return func(*args)
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            # .cuda() of a tensor already "on the device" returns the tensor itself, as CUDA torch does.
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].dtype in _CUDA_TYPE_NAMES:
            # The (distributed) optimizer dispatches on 'torch.cuda.*Tensor' names; report CPU tensors that way.
            return _CUDA_TYPE_NAMES[args[0].dtype]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if func in (torch.Tensor.to, torch.Tensor.pin_memory) and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.pin_memory:
            # Pinned memory needs a CUDA build; pageable memory is the CPU equivalent.
            return args[0]
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


class _NoOpStream:
    """Stands in for torch.cuda.Stream/Event: on the CPU everything is already ordered and synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _NoOpStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def wait_stream(self, *args: Any) -> None: ...

    def wait_event(self, *args: Any) -> None: ...

    def wait(self, *args: Any) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def record(self, *args: Any) -> None: ...

    def record_event(self, event: Any = None) -> _NoOpStream:
        # MoE code keeps the returned event and waits on it later, so an object must come back.
        return event if event is not None else _NoOpStream()

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _run_eager() -> None:
    """Megatron's ``jit_fuser`` functions (activations, router, norms) run uncompiled on the CPU. It wraps them in
    torch.compile, which on a CPU rank traces them with Dynamo and builds C++ kernels with the host compiler at
    their first call: 1.5 s of the first step of a one-rank Nemotron proxy (2.80 -> 1.29 s), and its later steps
    were slower compiled (1.43 against 1.21 s). Eager is the arithmetic the compiled kernels fuse, and a CPU
    machine then needs no C++ compiler. The switch is Dynamo's own run-time flag, so functions decorated before
    this call (a warm rank imports megatron-core before its trial) run eager too; torch keeps it per thread, so it
    is set with the mode, in the thread that runs the trial."""
    from torch._dynamo import config as dynamo_config

    dynamo_config.disable = True


def _patch_torch_cuda() -> None:
    # Megatron allocates on torch.cuda.current_device(). Returning the CPU device (not an index) matters: custom
    # autograd functions allocate this way in backward, which runs while the device mode is suspended (a mode is
    # popped while its own __torch_function__ runs, and torch.autograd.backward is such a call).
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment,return-value]
    torch.cuda.Stream = _NoOpStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _NoOpStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _NoOpStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _NoOpStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None
    # The "CUDA" generator of a CPU build is the CPU one (as the RNG tracker below): Megatron-FSDP's adapter
    # copies TP rank 0's RNG states, this one included, to the other TP ranks.
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _patch_megatron_without_te() -> None:
    """megatron-core 0.16.1's own bugs when Transformer Engine is not installed, on any device (0.19 has the fixes:
    each is mended only where it is found)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # The router references an undefined name (NameError at the first MoE forward); None selects the torch path.
    if not hasattr(moe_utils, "te_general_gemm"):
        replace(moe_utils, "te_general_gemm", None)
    # megatron.core.extensions.transformer_engine still imports and exports MagicMocks for its classes, so
    # multi_latent_attention sets HAVE_TE and then calls isinstance(x, <MagicMock>) (TypeError).
    import megatron.core.extensions.transformer_engine as te_extensions
    import megatron.core.transformer.multi_latent_attention as mla

    if not getattr(te_extensions, "HAVE_TE", True):
        if mla.HAVE_TE:  # megatron-core 0.16.1; from 0.19 it is TE's own flag
            replace(mla, "HAVE_TE", False)
        # MLASelfAttention gives the duplicated-mode arguments to the class it knows as TELinear (a MagicMock in
        # 0.16.1, None from 0.19): the local spec's down projections are that layer's local twin (cpu/linear.py).
        from sweeper.backends.megatron.cpu.linear import DuplicatedLinear

        replace(mla, "TELinear", DuplicatedLinear)
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter

    if hasattr(adapter, "TELinear") and not isinstance(adapter.TELinear, type):
        # Its TELinear is a MagicMock too (0.16.1; the name is gone from 0.19), and the adapter's
        # isinstance(module, (TELinear,)) raises (TypeError) at TP > 1. No module of a model built without TE is a
        # TELinear.
        replace(adapter, "TELinear", type("NoTELinear", (), {}))


def _patch_megatron() -> None:
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # "CUDA" RNG state on a CPU build is the CPU generator's state: tracker forks and activation recompute
    # (CheckpointFunction) save/restore it through these two functions.
    replace(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    replace(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    replace(mrandom, "CudaRNGStatesTracker", _make_cpu_tracker(mrandom.CudaRNGStatesTracker))
    # A tracker created before install (e.g. by an import) would be the CUDA one; force the next one to be ours.
    mrandom.initialize_rng_tracker(force_reset=True)
    _patch_alltoall_dispatcher(moe_utils)
    _patch_megatron_fsdp()
    from megatron.core.tensor_parallel import layers

    from sweeper.backends.megatron.cpu.experts import GroupedLinear

    for function in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight,
                     GroupedLinear):
        products_in_fp32_on_backward(function)
    _patch_optimizer_fallbacks()


def _patch_optimizer_fallbacks() -> None:
    """Without TE or Apex, megatron-core's optimizer falls back to per-tensor Python loops: torch's AdamW in its
    for-loop form, a grad-norm that turns every tensor's norm into a Python float, a scale that copies tensor by
    tensor. A MoE proxy has thousands of parameter tensors (Nemotron's: 52 layers x 128 experts x 2), so these loops
    were a sixth of a CPU step (benchmarks/proxy_step.py). The same math through torch's foreach kernels: norms
    with _foreach_norm, the scale with _foreach_mul (Adam's foreach form: build.py, foreach_adam)."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as base

    if getattr(clip_grads, "l2_norm_impl", None) is not None and clip_grads.l2_norm_impl.__module__ == \
            "megatron.core.utils":
        replace(clip_grads, "l2_norm_impl", _foreach_l2_norm)
        replace(clip_grads, "multi_tensor_scale_impl", _foreach_scale)
    if getattr(base, "multi_tensor_scale_impl", None) is not None and base.multi_tensor_scale_impl.__module__ == \
            "megatron.core.utils":
        replace(base, "multi_tensor_scale_impl", _foreach_scale)


def _foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
                     *args: Any) -> tuple[torch.Tensor, None]:
    """megatron.core.utils.local_multi_tensor_l2_norm's result (the norm of every tensor's norm, on "cuda")."""
    norms = [n for tensors in tensor_lists if tensors for n in torch._foreach_norm(tensors)]  # noqa: SLF001 - torch's foreach kernel
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    return total.reshape(1).to(torch.float, copy=True), None


def _foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    """megatron.core.utils.local_multi_tensor_scale: dst = src * scale, tensor by tensor."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if src:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))  # noqa: SLF001 - torch's foreach kernels


def _patch_megatron_fsdp() -> None:
    """MegatronFSDP.__init__ formats ``torch.device(f"cuda:{torch.cuda.current_device()}")`` to compare with the
    device it was given (megatron_fsdp.py, megatron-core 0.16.1), even when the caller passes the CPU. With the
    patched ``current_device`` (the CPU device, not an index) that is ``torch.device("cuda:cpu")``: RuntimeError.
    While that constructor runs, ``current_device`` returns index 0 (what a CUDA build returns on one device); its
    buffers are allocated on the device passed in, and a stray int device still goes through the device mode.
    Measured on gloo: Megatron-FSDP's losses equal DDP's with the distributed optimizer, bitwise or within an ulp
    (DP2 and TP2xDP2, all three sharding strategies, FP32 and BF16; docs/MEGATRON_ON_CPU.md). It logs a harmless
    "using device cpu instead of cuda:0" warning."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp

    init = megatron_fsdp.MegatronFSDP.__init__
    if getattr(init, "sweeper_cpu", False):
        return

    def init_with_device_index(self: Any, *args: Any, **kwargs: Any) -> None:
        current = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current

    init_with_device_index.sweeper_cpu = True  # type: ignore[attr-defined]
    replace(megatron_fsdp.MegatronFSDP, "__init__", init_with_device_index)
    _patch_megatron_fsdp_collectives()


class _Completed:
    """The work object of collectives that have already completed."""

    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _patch_megatron_fsdp_collectives() -> None:
    """Megatron-FSDP's parameter all-gathers complete before it can free a bucket (gloo).

    Megatron-FSDP issues its bucket all-gathers with async_op=True inside ``_coalescing_manager`` blocks and frees
    (``storage.resize_(0)``) buckets marked as reusable in the same block, after "waiting" for their gather. On
    gloo a coalesced collective runs when the block exits and an async one on gloo's worker thread, so a bucket
    could be freed before the gather that writes into it ran: a write into freed host memory. Measured with
    optim_grads_params (which frees the unsharded weight buckets), 6 steps on DP2: 1 run in 5 ended in a
    segmentation fault or a glibc heap-corruption abort; on CUDA the caching allocator keeps such memory mapped.
    Here Megatron-FSDP's coalescing blocks are plain blocks (each collective runs when called, as NCCL outside a
    group would) and every bucket all-gather is waited for as soon as it is issued, so nothing is in flight when
    a bucket is freed. It only serialises communication that gloo ran synchronously anyway."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers

    pipeline = buffers.AllGatherPipeline
    gather = pipeline.async_bucket_gather
    if getattr(gather, "sweeper_cpu", False):
        return

    @contextlib.contextmanager
    def uncoalesced(*args: Any, **kwargs: Any) -> Iterator[_Completed]:
        yield _Completed()

    def async_bucket_gather(self: Any, bucket_id: int, bwd: bool) -> None:
        gather(self, bucket_id, bwd)
        event = self.param_gather_event_map.get(self.get_bucket_key(bucket_id, bwd))
        if event is not None and event[0] is not None:
            event[0].wait()

    async_bucket_gather.sweeper_cpu = True  # type: ignore[attr-defined]
    replace(buffers, "_coalescing_manager", uncoalesced)
    replace(pipeline, "async_bucket_gather", async_bucket_gather)


def _patch_alltoall_dispatcher(moe_utils: Any) -> None:
    """The alltoall token dispatcher on the CPU. It hands its expert-parallel split sizes to all_to_all_single after
    ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which only converts CUDA tensors: on the CPU the sizes stayed
    int64 tensors, which c10d's all_to_all_single binding refuses (for every backend). A host tensor becomes the
    numpy array a GPU's device-to-host copy gives. With ETP > 1 and EP > 1 the dispatcher also all-gathers uneven
    token splits over the expert-tensor group, which gloo refuses ("ProcessGroupGloo::allgather: invalid tensor
    size"); ``_all_gather_uneven`` pads, gathers and cuts. Measured: losses and gradient norms bit-identical to the
    allgather dispatcher at EP2 and TP2-SP-EP2 (fp32, bf16, routing stress), within 4e-8 at TP2-SP-EP2-ETP2."""
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    move = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().clone().numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    replace(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    replace(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)  # imported by name there
    if not getattr(torch.distributed.all_gather, "sweeper_uneven", False):
        torch.distributed.all_gather = _all_gather_uneven(torch.distributed.all_gather)


def _all_gather_uneven(all_gather: Callable[..., Any]) -> Callable[..., Any]:
    """torch.distributed.all_gather that also takes a list of tensors differing in their first dimension (what
    NCCL takes and gloo refuses): each rank's tensor is padded to the longest, gathered, and its rows copied out."""

    def gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
        uneven = (not async_op and tensor.dim() > 0 and len({tuple(t.shape) for t in tensor_list}) > 1
                  and all(t.shape[1:] == tensor.shape[1:] for t in tensor_list))
        if not uneven:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]].copy_(tensor)
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        all_gather(gathered, padded, group=group)
        for out, got in zip(tensor_list, gathered, strict=True):
            out.copy_(got[: out.shape[0]])
        return None

    gather.sweeper_uneven = True  # type: ignore[attr-defined]
    return gather


def _make_cpu_tracker(base: type) -> type:
    class CpuRNGStatesTracker(base):
        """Megatron's RNG tracker (same state names, same fork semantics) holding CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker

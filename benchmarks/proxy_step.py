"""Where a proxy training step spends its time on the CPU, and what the grouped experts save (issue 31).

One gloo rank builds the flagship proxy the way the proxy sweep's reference does (FP32, one rank, the proxy sweep's
sequence length and batch) and times forward/backward + optimizer steps twice in the same process: with
``GroupedSequentialMLP`` (the CPU spec's experts) and with megatron-core's own ``SequentialMLP`` loop. Then one
step under cProfile, its time summed by the source module it is spent in (experts, router, Mamba, attention,
optimizer, ...). Prints one table per model; the ratio is measured in this run.

    python benchmarks/proxy_step.py [--models nemotron-3-nano-30b-a3b deepseek-v2-lite] [--steps 3]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import time


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What one step is made of, as cProfile's cumulative time of these functions (file part, function name): the
# forward of each kind of leaf module, the whole backward, the optimizer step. Forward parts do not nest.
_PARTS = (
    ("experts forward", ("moe/experts.py", "cpu/experts.py"), "forward"),
    ("router forward", ("moe/router.py",), "forward"),
    ("token dispatch / combine", ("moe/token_dispatcher.py",), ("token_dispatch", "token_combine",
                                                                "dispatch_preprocess", "combine_postprocess")),
    ("Mamba mixer forward", ("cpu/mamba.py", "ssm/mamba_mixer.py"), "forward"),
    ("core attention forward", ("cpu/attention.py", "dot_product_attention.py"), "forward"),
    ("linear layers forward", ("tensor_parallel/layers.py",), "forward"),
    ("norms forward", ("torch_norm.py", "cpu/norm.py"), "forward"),
    ("backward (all)", ("~",), "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
    ("optimizer step", ("optimizer/optimizer.py", "optimizer/distrib_optimizer.py"), "step"),
    ("whole step", ("steps.py",), "train_step"),
)


def _parts(stats: pstats.Stats, parts: tuple = _PARTS) -> dict[str, float]:
    """Cumulative time of each part of ``parts`` ((name, file parts, function names) rows) in ``stats``."""
    out = {name: 0.0 for name, _, _ in parts}
    for (filename, _, func), (_, _, _, cumtime, callers) in stats.stats.items():  # type: ignore[attr-defined]
        for name, files, funcs in parts:
            funcs = (funcs,) if isinstance(funcs, str) else funcs
            if func in funcs and any(f in filename for f in files):
                # Recursive or nested calls of the same kind (a forward calling its parent's forward) count once.
                if not any(any(f in c[0] for f in files) and c[2] in funcs for c in callers):
                    out[name] += cumtime
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["nemotron-3-nano-30b-a3b", "deepseek-v2-lite"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from sweeper.backends.megatron.cpu import compat

    compat.install()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state

    from sweeper.backends.megatron.build import build
    from sweeper.backends.megatron.cpu.experts import GroupedSequentialMLP
    from sweeper.backends.megatron.steps import micro_batches, train_step
    from sweeper.config.load import PROXY_GLOBAL_BATCH_CAP, PROXY_SEQ_LENGTH_CAP
    from sweeper.models.catalog import preset
    from sweeper.models.proxy import proxy
    from sweeper.space.layout import Layout

    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    seq, gbs = PROXY_SEQ_LENGTH_CAP, 4  # the reference's batch: a few sequences, mbs 1
    layout = Layout(world_size=1, gbs=gbs, mbs=1, precision="fp32")
    print(f"one rank, FP32, seq {seq}, {gbs} micro-batches of 1 per step (the proxy sweep caps gbs at "
          f"{PROXY_GLOBAL_BATCH_CAP}); {args.steps} timed steps after one warm-up")
    for name in args.models:
        spec = proxy(preset(name))
        built = build(spec, layout, cuda=False, te=False, seed=1)

        def step(i: int, built=built) -> None:
            batches = micro_batches(seed=1, step=i, layout=layout, seq_length=seq, vocab_size=spec.vocab_size,
                                    device=torch.device("cpu"))
            train_step(built, layout, batches, seq)

        timings = {}
        grouped = GroupedSequentialMLP.grouped
        for label, switch in (("grouped experts", grouped), ("Megatron's SequentialMLP loop", lambda self: False)):
            GroupedSequentialMLP.grouped = switch  # type: ignore[method-assign]
            step(0)
            start = time.perf_counter()
            for i in range(args.steps):
                step(i + 1)
            timings[label] = (time.perf_counter() - start) / args.steps
        GroupedSequentialMLP.grouped = grouped  # type: ignore[method-assign]
        profile = cProfile.Profile()
        profile.enable()
        step(99)
        profile.disable()
        by_part = _parts(pstats.Stats(profile))
        total = by_part["whole step"]
        params = sum(p.numel() for p in built.named_parameters().values())
        print(f"\n{spec.name}: {params / 1e6:.1f}M parameters, {spec.num_layers} layers, "
              f"{spec.num_moe_experts} experts (top-{spec.moe_router_topk})")
        for label, seconds in timings.items():
            print(f"  {label:32s} {seconds:6.2f} s per step")
        loop, fast = timings["Megatron's SequentialMLP loop"], timings["grouped experts"]
        print(f"  {'ratio (loop / grouped)':32s} {loop / fast:6.2f}x")
        print("  one grouped step under cProfile, by part (cumulative time; the profiler's overhead included):")
        for part, seconds in by_part.items():
            print(f"    {part:30s} {seconds:6.2f} s  {100 * seconds / total:5.1f}%")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

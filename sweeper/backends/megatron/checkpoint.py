"""Distributed (sharded) checkpoint of the smoke run's model: save with torch_dist, load back, compare bitwise.

The save is Megatron's ``dist_checkpointing.save`` of the model chunks' sharded state dicts (Megatron-LM's key
layout: ``model`` or ``model0``, ``model1``... with virtual stages), so the checkpoint is resharding-capable.
The reload test poisons every parameter with NaN, loads the checkpoint into the same model and requires each
parameter to be bit-identical with what was saved: a checkpoint that silently misses a tensor fails. Every
module's non-empty ``_extra_state`` (Transformer Engine's FP8 scales and amax history) must come back from the
checkpoint byte for byte too.
Only model weights are saved (no optimizer state): the smoke run proves the sharded write/read path.

Megatron-FSDP layouts save the way Megatron-LM's ``--ckpt-format fsdp_dtensor`` does: torch.distributed.checkpoint
(DCP) of the wrapped model's state dict, whose parameters are DTensors sharded (unevenly) over the data-parallel
ranks, after Megatron's ``preprocess_state_dict_for_uneven_dtensor``. torch_dist cannot save them (the bare chunks'
sharded_state_dict gives wrong global shapes for the FSDP-sharded parameters, measured). Their reload check poisons
every rank's shard of every distributed parameter, loads with DCP into those shards, installs them into the model
weights and compares the shards bitwise. The torch_dist loader here (``load_chunks``) still serves the equivalence
gate: it loads the reference into the bare chunks before build wraps them.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state

from sweeper.backends.megatron.build import Built
from sweeper.backends.megatron.failures import CheckpointError
from sweeper.record.checkpoints import checkpoint_folder


def checkpoint_path(trial_dir: str, step: int) -> Path:
    return checkpoint_folder(trial_dir) / f"iter_{step:07d}"


def _sharded_state_dict(chunks: list[Any]) -> dict:  # MegatronModule chunks
    # The metadata every module below fills in for itself when given none; GPTModel.sharded_state_dict of
    # megatron-core 0.16.1 reads it directly for an MTP stage's embedding copy (metadata['dp_cp_group']) and fails
    # on None, so it is given as Megatron-LM's checkpointing gives it.
    def metadata() -> dict[str, Any]:
        return {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}

    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict(metadata=metadata())}
    return {f"model{i}": chunk.sharded_state_dict(metadata=metadata()) for i, chunk in enumerate(chunks)}


def _use_in_process_results_queue() -> None:
    """Megatron's torch_dist writer collects write results through a queue that it creates, on first use, from a
    *spawned* multiprocessing Manager: a server process per rank, ~5 s to start, and a main module that must be
    import-safe. That queue only crosses a process boundary for asynchronous saves; this save is synchronous (the
    writer runs in this process), so an in-process queue serves the same purpose."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "missing") is None:
        filesystem_async._results_queue = queue.Queue()  # noqa: SLF001 - the module global it forgot to set


def save(built: Built, directory: Path) -> None:
    if torch.distributed.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    # Every rank writes its shards into the directory rank 0 created.
    torch.distributed.barrier()
    os.makedirs(directory, exist_ok=True)
    if built.fsdp:
        from torch.distributed import checkpoint as dcp

        dcp.save(_fsdp_state_dict(built), checkpoint_id=str(directory))
        return
    _use_in_process_results_queue()
    # megatron-core's default strategy, torch_dist (0.19 no longer takes it as a ("torch_dist", 1) tuple).
    dist_checkpointing.save(_sharded_state_dict(built.bare_chunks()), str(directory))


def load(built: Built, directory: Path) -> list[dict[str, Any]] | None:
    """Load the checkpoint's weights into the model chunks (as saved by ``save``); the state dict each chunk
    loaded (torch_dist; None for Megatron-FSDP's DCP load, which loads in place)."""
    if built.fsdp:
        from torch.distributed import checkpoint as dcp

        # In place: the state dict's DTensors are this rank's shards of the distributed parameters.
        dcp.load(_fsdp_state_dict(built), checkpoint_id=str(directory))
        for chunk in built.model:
            # As after an optimizer step: the shards (FP32 main weights in mixed precision) into the model
            # weights, then the all-gather that makes the full weights the next forward uses.
            chunk.module.install_optimized_model_weights()
            chunk.start_param_sync(force_sync=True)
        return None
    return load_chunks(built.bare_chunks(), directory)


def load_chunks(chunks: list[torch.nn.Module], directory: Path) -> list[dict[str, Any]]:
    """Load a torch_dist checkpoint's weights into bare model chunks, and return the state dict each loaded. The
    checkpoint may come from another layout: each rank asks for its shards of the global tensors (Megatron's
    resharding across TP/PP/VPP/EP/ETP)."""
    loaded = dist_checkpointing.load(_sharded_state_dict(chunks), str(directory))  # the strategy it was saved with
    states = [loaded["model" if len(chunks) == 1 else f"model{i}"] for i in range(len(chunks))]
    for chunk, state in zip(chunks, states):
        chunk.load_state_dict(state, strict=True)
    return states


def _fsdp_state_dict(built: Built) -> dict[str, Any]:
    """Megatron-LM's fsdp_dtensor model state: each chunk's Megatron-FSDP state dict (its pre-hook swaps the
    distributed parameters in), keyed like the torch_dist one, with the uneven shards' chunk metadata that DCP's
    planner needs."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

    # Experts by their global index (Megatron-LM does the same): local_experts.<i> names another expert on each
    # expert-parallel rank, and the ranks' keys would collide. Renamed keys keep their tensors (loads in place).
    chunks = [handle_experts_in_state_dict(chunk.module.state_dict(), built.config.num_moe_experts)
              for chunk in built.model]
    state = {"model": chunks[0]} if len(chunks) == 1 else {f"model{i}": sd for i, sd in enumerate(chunks)}
    return preprocess_state_dict_for_uneven_dtensor(state)


def resharding(chunks: list[torch.nn.Module], directory: Path) -> tuple[list[str], list[str]]:
    """(every tensor key this rank loads, the keys of those it loads resharded): a tensor is resharded when a
    shard this rank asks for is not exactly one chunk the checkpoint stored (other offsets or sizes, i.e. the
    writing layout split it otherwise), so the load reads parts of several stored chunks."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    wanted = _sharded_state_dict(chunks)
    apply_factories(wanted)
    keys: dict[str, bool] = {}
    for sh in nested_values(wanted):
        if not isinstance(sh, ShardedTensor):
            continue
        chunk = (tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        written = {(tuple(c.offsets), tuple(c.sizes)) for c in getattr(stored.get(sh.key), "chunks", ())}
        keys[sh.key] = keys.get(sh.key, False) or chunk not in written
    return sorted(keys), sorted(k for k, moved in keys.items() if moved)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: its shard of a Megatron-FSDP DTensor, the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def snapshot(built: Built) -> dict[str, torch.Tensor]:
    """A host-memory copy of this rank's parameters (on a GPU a device copy would hold a second set of weights
    during the save, where a layout could run out of memory that training never needs)."""
    return {name: _local(p).detach().to("cpu", copy=True) for name, p in built.named_parameters().items()}


def extra_states(chunks: list[torch.nn.Module]) -> dict[tuple[int, str], bytes]:
    """(chunk, state-dict key) -> the bytes of every non-empty ``_extra_state`` of the chunks' modules: Transformer
    Engine keeps its FP8 metadata there (scales, amax history), which are not parameters."""
    out: dict[tuple[int, str], bytes] = {}
    for i, chunk in enumerate(chunks):
        # The chunk's state dict names them as the checkpoint does (Float16Module passes its inner model's keys).
        for key, value in chunk.state_dict().items():
            if key.rsplit(".", 1)[-1] == _EXTRA_STATE and (data := _extra_bytes(value)):
                out[(i, key)] = data
    return out


_EXTRA_STATE = "_extra_state"  # torch.nn.Module's state-dict key for what get_extra_state() returns


def _extra_bytes(value: Any) -> bytes:
    """An extra state as bytes to compare: a tensor's storage, a BytesIO's contents, else its pickle."""
    if value is None:
        return b""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b""
    if isinstance(value, io.BytesIO):
        return value.getvalue()
    return pickle.dumps(value)


def compare_extra_states(saved: dict[tuple[int, str], bytes], loaded: list[dict[str, Any]]) -> list[str]:
    """The keys of saved extra states that the checkpoint did not give back byte for byte (a checkpoint that lost
    or altered FP8 scales). The modules' own state after the load is not compared: Transformer Engine may
    serialize the same metadata differently once set back (not verified on a GPU yet)."""
    bad = []
    for (i, key), value in saved.items():
        if _extra_bytes(loaded[i].get(key)) != value:
            bad.append(key if len(loaded) == 1 else f"model{i}.{key}")
    return bad


def reload_and_compare(built: Built, directory: Path, saved: dict[str, torch.Tensor],
                       saved_extra: dict[tuple[int, str], bytes] | None = None) -> None:
    """Load the checkpoint into the model after poisoning it; raise CheckpointError on any difference: in a
    parameter, or in a module's ``_extra_state`` (``saved_extra``, from ``extra_states`` before the save)."""
    with torch.no_grad():
        for param in built.named_parameters().values():
            _local(param).fill_(float("nan"))
        if built.fsdp:  # the model weights too: install copies the poisoned shards into them
            for chunk in built.model:
                chunk.module.install_optimized_model_weights()
    loaded = load(built, directory)
    current = {name: _local(p).detach().cpu() for name, p in built.named_parameters().items()}
    bad = [name for name, value in saved.items() if not _bit_equal(value, current[name])]
    if bad:
        raise CheckpointError(
            f"checkpoint reload differs from the saved weights in {len(bad)} of {len(saved)} tensors "
            f"(first: {bad[0]})"
        )
    if saved_extra and loaded is not None:
        lost = compare_extra_states(saved_extra, loaded)
        if lost:
            raise CheckpointError(
                f"checkpoint reload differs from the saved extra state (FP8 metadata) in {len(lost)} of "
                f"{len(saved_extra)} modules (first: {lost[0]})"
            )


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8))

"""Data-parallel training with PyTorch's own engine: DDP and FSDP2, applied to a finished model.

Launch with torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT:

    torchrun --standalone --nproc_per_node 2 -m decoderlm train ... --strategy ddp

- DDP (Li et al., 2020): every rank holds the full model; gradients are all-reduced (averaged) in
  buckets during the backward pass, so after `optimizer.step()` all replicas stay identical.
- FSDP2 (`torch.distributed.fsdp.fully_shard`; Zhao et al., 2023): every block, then the root, owns a
  1/N shard of its parameters (DTensors); the full weights are all-gathered just before a block runs
  and gradients are reduce-scattered after its backward. Same maths as DDP, 1/N of the memory.

The model code never changes (torchtitan style). Without torchrun (no WORLD_SIZE, or WORLD_SIZE=1)
everything here is a no-op: no process group, no wrapper, no communication.

How the trainer uses it (all calls are collective: every rank makes them, in the same order):

    info = init_distributed(device)                       # first thing, on every rank
    model = wrap_model(DecoderLM(cfg).to(info.device), strategy, info)
    optimizer = AdamW(model.parameters(), ...)            # after wrapping (FSDP2 swaps in DTensors)
    for micro in range(accum):                            # each rank: its rows of the global batch
        with grad_sync(model, enabled=micro == accum - 1):
            loss = loss_fn(model(x), y) / accum           # forward AND backward inside the `with`
            loss.backward()
    optimizer.step()
    global_loss = all_reduce_mean(loss_sum, info)         # the same float on every rank
    model_sd, optim_sd = full_state_dicts(model, optimizer)  # full on rank 0, {} elsewhere
    run_on_main(lambda: save(model_sd, optim_sd), info)   # written once; a failure stops all ranks
    ...
    shutdown(info)

The state dicts have plain parameter names (no `module.` / `_orig_mod.` prefixes, no DTensors) and
optimizer state keyed by parameter name, whatever the strategy, so a checkpoint written by N ranks
resumes on 1 and vice versa.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from decoderlm.errors import DecoderLMError

STRATEGIES = ("none", "ddp", "fsdp")
T = TypeVar("T")

# A rank that waits longer than this in a collective (a peer hangs) raises instead of waiting forever,
# and torchrun then stops the whole job (a peer that dies is noticed at once). Long enough for rank 0
# to evaluate or write a large checkpoint while the others wait: torch's own default for gloo.
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job. world_size == 1 means a plain single process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, evaluates, shows progress and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DecoderLMError(f"environment variable {name}={value!r} is not an integer") from None


def _resolve_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DecoderLMError(f"device {device!r} requested but CUDA is not available")
        # One GPU per process: torchrun's LOCAL_RANK picks it, unless an index was given.
        dev = torch.device("cuda", local_rank if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    return dev


def init_distributed(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> DistInfo:
    """Join the torchrun job described by RANK/WORLD_SIZE/LOCAL_RANK, or run as one process.

    device: "auto" (CUDA if available, else CPU), "cpu", "cuda" or "cuda:N". Under torchrun each
    process takes GPU LOCAL_RANK. Backend: nccl for CUDA tensors plus gloo for CPU ones, or gloo
    alone on the CPU. Without WORLD_SIZE (or with WORLD_SIZE=1) no process group is created.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise DecoderLMError(f"RANK={rank} is not in [0, WORLD_SIZE={world_size})")
    dev = _resolve_device(device, local_rank)
    info = DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)
    if world_size == 1 or dist.is_initialized():
        return info
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise DecoderLMError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun"
        )
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    # FSDP2's modules hold the process group in reference cycles. Left to the interpreter's
    # teardown they are freed after the C++ runtime has started to go, and the process aborts
    # ("terminate called without an active exception", 1 run in ~5 here): collect them first.
    atexit.register(gc.collect)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=dev if dev.type == "cuda" else None,
    )
    return info


def wrap_model(model: nn.Module, strategy: str, info: DistInfo) -> nn.Module:
    """Apply the data-parallel strategy to a model already on `info.device`.

    "none": the model itself (only valid for one process). "ddp": DistributedDataParallel.
    "fsdp": FSDP2, `fully_shard` on every block then on the root (the embeddings, final norm and
    head form the root's group; a tied head stays tied). With one process every strategy returns
    the model unchanged. Rank 0's initial weights are copied to every rank, so all replicas start
    identical even if the ranks were seeded differently.
    """
    if strategy not in STRATEGIES:
        raise DecoderLMError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if not info.distributed:
        return model
    if strategy == "none":
        raise DecoderLMError(
            f"strategy 'none' cannot train with {info.world_size} processes: use ddp or fsdp"
        )
    if strategy == "ddp":
        # DDP broadcasts rank 0's parameters and buffers at construction. A frozen base (LoRA) is
        # left out: every rank loaded it from the same file, which may be mapped read-only.
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            frozen += [name for name, _ in model.named_buffers()]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def grad_sync(wrapped: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Context for one micro-step; with enabled=False its backward skips the gradient all-reduce.

    Gradient accumulation: sync only on the last micro-step (the others just accumulate local
    gradients). Run forward and backward inside the `with`. A no-op for a plain model.
    """
    wrapped = getattr(wrapped, "_orig_mod", wrapped)  # see through torch.compile
    if enabled:
        return contextlib.nullcontext()
    if isinstance(wrapped, DistributedDataParallel):
        return wrapped.no_sync()
    if isinstance(wrapped, FSDPModule):
        return _fsdp_no_sync(wrapped)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(module: FSDPModule) -> Iterator[None]:
    module.set_requires_gradient_sync(False)  # recurses into every fully_shard'ed block
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def full_state_dicts(
    wrapped: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts as full CPU tensors with plain parameter names.

    Collective: call it on every rank. Rank 0 receives the full dicts; with several processes the
    other ranks receive empty dicts (nothing is gathered onto them). The optimizer's state is keyed
    by parameter name, so it loads into any strategy and any number of processes. Call it after
    the first optimizer step (on a fresh optimizer torch materialises the state with a zero step).
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(wrapped, optimizer, options=options)
    return model_sd, optim_sd


def load_full_state_dicts(
    wrapped: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any],
    info: DistInfo,
    strict: bool = True,
) -> None:
    """Load full state dicts (as made by `full_state_dicts`, on any number of ranks) into every rank.

    Collective. With several processes only rank 0's dicts are used: rank 0 broadcasts each tensor
    and every rank keeps its own part (FSDP2) or a full copy (DDP); other ranks may pass {}.
    strict=False: `model_sd` may hold some of the model's tensors only (a LoRA run's adapters).
    """
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=info.distributed, strict=strict
    )
    # Two calls, not set_state_dict: that one skips the model on a rank whose model dict is empty.
    # The optimizer goes first: materialising its state runs a zero-lr step on the parameters.
    set_optimizer_state_dict(wrapped, optimizer, optim_sd, options=options)
    set_model_state_dict(wrapped, model_sd, options=options)


def all_reduce_mean(value: float | Tensor, info: DistInfo) -> float:
    """The mean of `value` over all ranks (a Python float), e.g. the global training loss."""
    if not info.distributed:
        return float(value)
    tensor = torch.as_tensor(value, dtype=torch.float64, device=info.device).detach().clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.item() / info.world_size


def run_on_main(fn: Callable[[], T], info: DistInfo) -> T | None:
    """Call `fn()` on rank 0 only (e.g. write a checkpoint); the other ranks wait for it.

    Collective. Returns fn's result on rank 0 and None elsewhere. If fn raises on rank 0, every rank
    raises: rank 0 its own exception, the others a DecoderLMError with the same message, so the
    whole job stops at once with the same one-line error instead of leaving ranks waiting.
    """
    if not info.distributed:
        return fn()
    result, error = None, None
    if info.is_main:
        try:
            result = fn()
        except BaseException as exc:
            error = exc
    message = [None if error is None else str(error) or type(error).__name__]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise DecoderLMError(f"stopped because rank 0 failed: {message[0]}")
    return result


def shutdown(info: DistInfo) -> None:
    """Leave the job (destroy the process group); safe to call more than once or without one."""
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()

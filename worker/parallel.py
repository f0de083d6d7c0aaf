"""Tensor parallelism inside each layer (Orca §4.1; Megatron-LM, Shoeybi et al. 2019, §3), one
worker made of `world_size` ranks that run every iteration together.

Split of a Llama layer across ranks, each holding 1/N of the heads and of the MLP:

- column-parallel Q, K, V (a rank's query heads and the K/V heads they attend with) and gate/up
  (a rank's slice of the intermediate width): no communication;
- attention per rank over its own heads, so the K/V cache splits with them: each rank's pools hold
  its K/V heads for every block, and a block (`block_size` token slots) spans all ranks;
- row-parallel O and down projections: each rank multiplies its slice, then one all-reduce (sum)
  gives every rank the full `[num_tokens, hidden]` output. Two all-reduces per layer.

Embedding, norms and the LM head are replicated. Collectives are `torch.distributed` (gloo on the
CPU, NCCL on CUDA); nothing home-made.

Rank 0 is the worker everyone else sees: its `Engine` schedules, samples and talks to Redis. Its
model is wrapped in `TensorParallelLeader`, which broadcasts every call that touches the model or
the K/V cache (a forward pass with its inputs and attention metadata, or a context shift) to the
followers before running it; each follower (`follower_main`, one process per rank) runs the same
call on its shard. Block allocation, sampling and bookkeeping happen on rank 0 only.

Weights are split while loading (`worker.loader.load_model(shard=...)`): a rank materialises one
full tensor at a time, keeps its slice, and never holds the whole model.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shoal.fleet import free_port
from worker.config import EngineConfig, ModelConfig

log = logging.getLogger("shoal.worker")

# A follower waits in a broadcast for rank 0's next call for as long as the worker is idle, so the
# collectives get no practical timeout; a rank that dies closes its sockets and its peers' pending
# collectives fail at once (and rank 0 also watches its followers' processes: `watch_followers`).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)

_COLUMN_PARALLEL = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight")
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank: 0 .. world_size - 1.
        world_size: ranks in the group (1 = no parallelism).
    """

    rank: int
    world_size: int

    def check(self, cfg: ModelConfig) -> None:
        """Raises ValueError unless the group size divides the query heads, the K/V heads and the
        MLP width (a rank holds whole heads, and the K/V heads its query heads attend with)."""
        n = self.world_size
        bad = [f"{what} ({x})" for what, x in (("query heads", cfg.num_heads),
                                                ("K/V heads", cfg.num_kv_heads),
                                                ("MLP width", cfg.intermediate_size)) if x % n]
        if bad:
            raise ValueError(f"--tensor-parallel-size {n} must divide the model's "
                             f"{', '.join(bad)}; sizes that divide them all: "
                             f"{_divisors(cfg)}")

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape one rank runs: 1/N of the heads and of the MLP width."""
        self.check(cfg)
        n = self.world_size
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // n,
                                   num_kv_heads=cfg.num_kv_heads // n,
                                   intermediate_size=cfg.intermediate_size // n)

    def shard(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor `name` (Hugging Face naming): rows of the
        column-parallel projections, columns of the row-parallel ones, all of anything else.
        Head-aligned because each projection's rows are whole heads in order."""
        if self.world_size == 1:
            return weight
        if name.endswith(_COLUMN_PARALLEL):
            return weight.chunk(self.world_size, dim=0)[self.rank].contiguous()
        if name.endswith(_ROW_PARALLEL):
            return weight.chunk(self.world_size, dim=1)[self.rank].contiguous()
        return weight

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum `x` over the group, in place (every rank gets the total)."""
        if self.world_size > 1:
            dist.all_reduce(x)

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' `value`s (so every rank sizes its K/V pools alike)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def _divisors(cfg: ModelConfig) -> list[int]:
    return [n for n in range(1, cfg.num_kv_heads + 1)
            if cfg.num_heads % n == 0 and cfg.num_kv_heads % n == 0
            and cfg.intermediate_size % n == 0]


def rank_config(cfg: EngineConfig, rank: int) -> EngineConfig:
    """`cfg` for one rank: on CUDA each rank has a GPU of its own (`cuda:<rank>`)."""
    from worker.config import default_device

    if (cfg.device or default_device()).startswith("cuda"):
        return dataclasses.replace(cfg, device=f"cuda:{rank}")
    return cfg


def init_group(rank: int, world_size: int, init_method: str, device: str = "cpu") -> TensorParallel:
    """Join the group (gloo on the CPU, NCCL on CUDA) and return this rank's place in it."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, world_size)


def _broadcast(obj: Any) -> Any:
    """Rank 0 sends `obj` (pickled) to every rank; others receive and return it."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TensorParallelLeader:
    """Rank 0's model: every call that touches the model or the K/V cache is first broadcast to
    the followers, then run here. Anything else is the wrapped `LlamaModel`'s."""

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, input_ids, positions, meta, kv_cache, output_rows=None, lora=None):
        assert lora is None, "LoRA adapters are not served with tensor parallelism"
        _broadcast(("forward", input_ids, positions, meta, output_rows))
        return self._model.forward(input_ids, positions, meta, kv_cache, output_rows)

    def shift_request_kv(self, kv_cache, block_table, keep, discard, length):
        _broadcast(("shift", block_table, keep, discard, length))
        return self._model.shift_request_kv(kv_cache, block_table, keep, discard, length)

    def stop_followers(self) -> None:
        """Tell the followers to exit (the worker is shutting down)."""
        _broadcast(("stop",))


def follower_main(rank: int, world_size: int, init_method: str, path: str, cfg: EngineConfig,
                  threads: int) -> None:
    """A follower rank's process: load its shard, size its K/V pools like rank 0, then run every
    call rank 0 broadcasts until told to stop."""
    from shoal.process import keep_freed_memory
    from worker.engine import Engine

    torch.set_num_threads(threads)
    keep_freed_memory()  # as rank 0's process does
    cfg = rank_config(cfg, rank)
    tp = init_group(rank, world_size, init_method, cfg.device or "cpu")
    model_cfg, weights = load_shard(Path(path), cfg.dtype, tp)
    _, model, kv_cache = Engine.build_parts(model_cfg, weights, cfg, tp)
    del weights
    try:
        while True:
            call = _broadcast(None)
            if call[0] == "forward":
                model.forward(call[1], call[2], call[3], kv_cache, call[4])
            elif call[0] == "shift":
                model.shift_request_kv(kv_cache, *call[1:])
            elif call[0] == "stop":
                return
    finally:
        dist.destroy_process_group()


def load_shard(path: Path, dtype: torch.dtype, tp: TensorParallel) -> tuple[ModelConfig, dict]:
    """This rank's shape and weights, split while loading.

    Raises:
        ValueError: the group size does not divide the model (see `TensorParallel.check`).
    """
    from worker.loader import load_model, read_model_config

    tp.check(read_model_config(path))
    model_cfg, weights = load_model(path, dtype, shard=tp.shard)
    return tp.local_config(model_cfg), weights


@dataclass
class Group:
    """A started tensor-parallel group as rank 0 sees it.

    Attributes:
        tp: rank 0's place.
        followers: the follower processes (ranks 1 .. N-1).
    """

    tp: TensorParallel
    followers: list

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.followers)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Join the followers (after `TensorParallelLeader.stop_followers`), killing any left."""
        for p in self.followers:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_group(world_size: int, path: Path, cfg: EngineConfig, threads: int) -> Group:
    """Start ranks 1 .. N-1 as processes and join the group as rank 0 (this process).

    Raises:
        ValueError: the size does not divide the model (checked before anything starts).
    """
    from worker.loader import read_model_config

    TensorParallel(0, world_size).check(read_model_config(path))
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = torch.multiprocessing.get_context("spawn")
    followers = [ctx.Process(target=follower_main, daemon=True, name=f"shoal-tp-rank{r}",
                             args=(r, world_size, init_method, str(path), cfg, threads))
                 for r in range(1, world_size)]
    for p in followers:
        p.start()
    return Group(init_group(0, world_size, init_method, rank_config(cfg, 0).device or "cpu"),
                 followers)


def watch_followers(group: Group, on_death: Callable[[str], None], interval_s: float = 0.5) -> None:
    """Call `on_death(reason)` once, from a daemon thread, when a follower process exits."""
    import threading
    import time

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            for p in group.followers:
                if not p.is_alive():
                    on_death(f"tensor-parallel {p.name} exited with code {p.exitcode}")
                    return

    threading.Thread(target=watch, daemon=True, name="shoal-tp-watch").start()


def rank_threads(total: int | None, world_size: int) -> int:
    """Torch threads per rank: the cores (or `total`) shared out, at least one."""
    return max(1, (total or os.cpu_count() or 1) // world_size)

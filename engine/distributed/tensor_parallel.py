"""Tensor parallelism on torch.distributed: the target model's attention heads and MLP split
across ranks, each rank a process holding its heads' share of every KV block.

How a layer splits (Megatron's way: QKV and gate/up by output, o and down by input with an
all-reduce after each, the LM head by vocabulary rows gathered to rank 0) is the model's own:
its layers are built knowing their share (engine.models.parallel) and take it as their weights
load, dense or quantized (by whole groups of 32 inputs). Embedding and norms are replicated:
after the last layer every rank holds the same hidden states. Splitting the head instead of
replicating it on rank 0: the head was 28% of a 0.5B model's weights, read every step by one
rank while the others waited (bench/RESULTS.md). Here: the gloo group (`Group`), the worker
processes, and a LoRA update x A B split with its layer (`shard_lora`).

Rank 0 is the engine's own process: it schedules, owns the block tables (one set for every
rank: a block id names the same positions in each rank's share of the cache) and samples.
Ranks 1..N-1 are worker processes (`engine.distributed.tensor_parallel.worker`) that load the same
checkpoint, keep their shard, and then follow rank 0: before each forward rank 0 broadcasts the
step's flat inputs (token ids, positions, block tables; each rank builds its attention metadata
from them) with the adapter slots that changed since the last, and before each copy-on-write
its block copies. A worker that dies breaks the group: rank 0's next collective raises (gloo
reports the closed connection at once), so the step fails and the engine stops instead of
waiting.

The rendezvous trusts no other process on the machine: the store and gloo's connections listen
on 127.0.0.1 only (TCPStore's own listener would take every interface), and each broadcast
carries an HMAC of its number and its bytes under a random token that rank 0 hands its workers
over their stdin, so a worker unpickles nothing a peer without the token sent (a wrong one is
a RendezvousError before any byte is unpickled), nor a message replayed out of turn.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import pickle
import secrets
import socket
import subprocess
import sys
import tempfile
import weakref
from contextlib import suppress
from functools import partial

import torch
import torch.distributed as dist

from engine.models.parallel import local_config

TIMEOUT = datetime.timedelta(seconds=120)  # a collective (and the start) waits no longer
HOST = "127.0.0.1"  # where the ranks meet: one machine, no other interface
_MAC_BYTES = 32  # an HMAC-SHA256


class RendezvousError(PermissionError):
    """A broadcast not signed with this group's token (another process on the machine, or a
    worker started with another token): refused before anything is unpickled."""


def local_store(world: int) -> dist.TCPStore:
    """Rank 0's store, listening on HOST only (given its socket: TCPStore binds every interface
    when it opens its own)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        HOST,
        port,
        world,
        is_master=True,
        wait_for_workers=False,
        timeout=TIMEOUT,
        master_listen_fd=listener.detach(),  # (the store owns the socket now)
    )


class Group:
    """One gloo process group of its own (not torch.distributed's default group, so several
    engines can live in one process), its connections on HOST: all-reduce and broadcast of
    Python objects from rank 0, each signed with the group's token (see the module's notes)."""

    def __init__(self, store: dist.Store, rank: int, world: int, token: bytes):
        self.rank, self.world, self.token = rank, world, token
        self.num_broadcasts = 0  # each one's number is in its MAC: none replays out of turn
        options = dist.ProcessGroupGloo._Options()
        options._timeout = TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
        self.pg = dist.ProcessGroupGloo(store, rank, world, options)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:  # in place, summed
        self.pg.allreduce([tensor]).wait()
        return tensor

    def _mac(self, data: bytes) -> bytes:
        number = self.num_broadcasts.to_bytes(8, "little")
        return hmac.new(self.token, number + data, hashlib.sha256).digest()

    def broadcast(self, obj: object = None) -> object:
        """Rank 0's obj on every rank (what others pass is ignored); a message whose MAC does
        not hold is a RendezvousError on the rank that got it, before it is unpickled."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.rank == 0:
            data = pickle.dumps(obj)
            data = self._mac(data) + data
        else:
            data = b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.pg.broadcast([size], opts).wait()
        if self.rank == 0:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(size), dtype=torch.uint8)
        self.pg.broadcast([buffer], opts).wait()
        if self.rank == 0:
            self.num_broadcasts += 1
            return obj
        received = buffer.numpy().tobytes()
        mac, data = received[:_MAC_BYTES], received[_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(data)):
            raise RendezvousError(
                f"rank {self.rank}: broadcast {self.num_broadcasts} is not signed with this "
                "group's token; refused unread"
            )
        self.num_broadcasts += 1
        return pickle.loads(data)

    def gather_columns(self, local: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's [M, its vocab rows] logits side by side on rank 0: [M, total] there
        (the others get their own back). Shares are padded to one width (gloo gathers equal
        sizes); see vocab_rows."""
        width = -(-total // self.world)
        if local.shape[1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self.pg.gather([], [local.contiguous()], opts).wait()
            return local
        parts = [torch.empty_like(local) for _ in range(self.world)]
        self.pg.gather([parts], [local.contiguous()], opts).wait()
        return torch.cat(parts, dim=1)[:, :total]


# LoRA modules (PEFT's names) whose projection is split by input; the others split by output.
ROW_SPLIT = ("o_proj", "down_proj")


def shard_lora(
    module: str, a: torch.Tensor, b: torch.Tensor, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's share of one module's LoRA update x A B (A [in, r], B [r, out]), split as the
    module is: a column-split module keeps its output columns of B; a row-split one (o_proj,
    down_proj) its input rows of A, so x_r A_r B is this rank's partial sum of x A B, and the
    all-reduce that completes the base projection completes the update with it."""
    if module in ROW_SPLIT:
        return a.chunk(world, 0)[rank].contiguous(), b
    return a, b.chunk(world, 1)[rank].contiguous()


def split_slots(slots, rank: int, world: int) -> None:
    """Adapter slots (built for the rank's shard) that keep the rank's shard of every adapter
    placed in them, and (rank 0) remember the placements for the other ranks."""
    slots.shard = partial(shard_lora, rank=rank, world=world)
    slots.placed = [] if rank == 0 else None


class Workers:
    """Ranks 1..N-1 as processes, started with the engine and following rank 0 (this process);
    stopped by close(), when the engine is collected, or at exit."""

    @classmethod
    def start(cls, config) -> Workers | None:
        return cls(config) if config.tensor_parallel_size > 1 else None

    def __init__(self, config):
        from engine.models.loader import target_path

        world = config.tensor_parallel_size
        target_path(config)  # converted once, before the ranks read it
        store = local_store(world)
        token = secrets.token_bytes(32)  # the workers' over their stdin, never on the network
        # each worker's output, read back when it dies; closed by close()
        self._logs = [tempfile.TemporaryFile() for _ in range(1, world)]  # noqa: SIM115
        self.procs = []
        # the workers import the code this process runs (a checkout's, not an installed copy)
        path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        for rank, log in enumerate(self._logs, start=1):
            main = f"from {__name__} import worker; worker({store.port}, {rank})"
            argv = [sys.executable, "-c", main]
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=log, env=env)
            proc.stdin.write(pickle.dumps((config, world, token)))
            proc.stdin.close()
            self.procs.append(proc)
        joined: list[Group] = []  # (the finalizer must not hold self)
        self.close = weakref.finalize(self, _stop, self.procs, self._logs, joined)
        self.group = self._checked(lambda: Group(store, 0, world, token))
        joined.append(self.group)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None:  # the ranks fail as this one did (a load): none is left behind
            self.close()

    def attach(self, runner, num_blocks: int) -> None:
        """Every rank has loaded its shard: size their KV caches, and have rank 0's runner tell
        them of each forward and block copy (and its adapter slots keep rank 0's shard)."""
        self._checked(lambda: self.group.broadcast(("start", num_blocks)))
        runner.workers = self
        if runner.lora_slots is not None:
            split_slots(runner.lora_slots, 0, self.group.world)

    def forward(self, flat, placed: list, token_slots: list[int] | None) -> None:
        """A forward of these flat inputs, after these adapter slot changes (LoRASlots.placed),
        with these rows' adapter slots (None: no adapter in the step)."""
        self._checked(lambda: self.group.broadcast(("forward", flat, placed, token_slots)))

    def logits(self, rows: list[int] | None) -> None:
        """The workers compute their share of the logits of the last forward's hidden rows
        `rows` (None: all), for the gather rank 0's LM head then does."""
        self._checked(lambda: self.group.broadcast(("logits", rows)))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self._checked(lambda: self.group.broadcast(("copy", copies)))

    def _checked(self, collective):
        """collective(), or, when a worker has died, an error carrying its last output."""
        try:
            return collective()
        except Exception as exc:
            dead = [(i, p) for i, p in enumerate(self.procs) if p.poll() is not None]
            if not dead:
                raise
            i, proc = dead[0]
            self._logs[i].seek(0)
            tail = self._logs[i].read().decode(errors="replace")[-2000:]
            raise RuntimeError(
                f"tensor-parallel worker {i + 1} exited ({proc.returncode}): {tail}"
            ) from exc


def _stop(procs: list[subprocess.Popen], logs: list, joined: list[Group]) -> None:
    """Tell the workers to stop (a broken group: they are gone or going), then make sure."""
    if joined and any(p.poll() is None for p in procs):
        with suppress(Exception):
            joined[0].broadcast(("stop",))
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for log in logs:
        log.close()


@torch.inference_mode()
def worker(port: int, rank: int) -> None:
    """One rank > 0: load the shard, then do what rank 0 broadcasts until it says stop."""
    from engine.backends import resolve_backend
    from engine.model_runner import ModelRunner
    from engine.models.kv_cache import kv_cache_format
    from engine.models.loader import load_target

    config, world, token = pickle.loads(sys.stdin.buffer.read())  # (rank 0's pipe)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    torch.set_flush_denormal(True)  # as rank 0 (LLMEngine) computes
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=TIMEOUT)
    group = Group(store, rank, world, token)
    model, cfg, _ = load_target(config, group)
    _, num_blocks = group.broadcast()
    backend = resolve_backend(config.attention_backend, config.torch_device)
    kv_format = kv_cache_format(config.kv_cache_dtype, model)
    shard = local_config(cfg, world)
    runner = ModelRunner(model, shard, num_blocks, config.block_size, backend, kv_format)
    slots, hidden = None, None  # hidden: the last forward's [N, hidden] (for "logits")
    if config.enable_lora:
        from lora.batch import LoRASlots

        shape = (runner.cfg, config.max_loras, config.max_lora_rank, runner.device, runner.dtype)
        slots = LoRASlots(*shape)
        split_slots(slots, rank, world)
    while True:
        message = group.broadcast()
        if message[0] == "stop":
            return
        if message[0] == "copy":
            runner.copy_blocks(message[1])
            continue
        if message[0] == "logits":
            runner.device_logits(hidden, message[1])  # (the gather keeps rank 0's)
            continue
        flat, placed, token_slots = message[1:]
        for slot, adapter in placed:
            slots.place(slot, adapter)
        lora = token_slots and backend.lora_batch(slots, token_slots)
        hidden = runner.forward_flat(flat, lora)

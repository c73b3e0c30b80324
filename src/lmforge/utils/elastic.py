"""Process-group start-up that survives torchrun's elastic restarts.

The bug this fixes (issue 19): torchrun (``--standalone``, ``--rdzv-backend c10d`` and the static
rendezvous alike) hands every restart of the workers the *same* TCPStore (``MASTER_ADDR:MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE=True``), and torch's ``env://`` rendezvous adds no per-attempt prefix
to it. The keys gloo uses to exchange its listening addresses (``default_pg/0/...``) therefore still
hold the addresses of the killed attempt's processes; a restarted worker that reads its peer's key
before the peer rewrote it connects to a dead port and ``init_process_group`` fails or hangs.

``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: on a multi-node job only the agent whose
worker failed counts a restart, the other agents restart theirs as a membership change, so the
count differs between nodes. Instead the ranks agree on a fresh *generation* through the store:

- rank 0 takes the next generation number with an atomic ``add`` (unique to this rank-0 process);
- every other rank queues a random nonce and blocks on ``ack/{nonce}``, which only a live rank 0
  can write, since the nonce is new; rank 0 answers every queued nonce with its generation, and
  stops when all other ranks counted themselves in ``ready/{gen}`` (a key no earlier attempt can
  have written);
- the process group is then built on the store prefixed with that generation, so no key of an
  earlier attempt is ever read.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lmforge.errors import ConfigError, LmforgeError
from lmforge.utils.device import env_int

NAMESPACE = "lmforge/elastic"
DEFAULT_TIMEOUT_S = 1800.0  # torch's own default for gloo; NCCL's is 10 minutes


class DistributedStartError(LmforgeError):
    """The ranks of a job did not all join within the process-group timeout."""


_generation: int | None = None  # this attempt's store generation, once the process group is up


QUIET_RANK_GRACE_S = 2.0


class ReportedByAnotherRank(LmforgeError):
    """Another rank found the error and reports it; this rank stops without printing it again."""

    quiet = True


@dataclass(frozen=True)
class LaunchEnv:
    """torchrun's variables of this process, checked (``launch_env``)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int


def launch_env() -> LaunchEnv:
    """torchrun's environment, every variable checked before anything is started: integers in range,
    and for more than one process the rendezvous address (``MASTER_ADDR``, ``MASTER_PORT``)."""
    world = env_int("WORLD_SIZE", 1, 1)
    rank = env_int("RANK", 0, 0)
    local_world = env_int("LOCAL_WORLD_SIZE", 1, 1)
    local_rank = env_int("LOCAL_RANK", 0, 0)
    node_rank = env_int("GROUP_RANK", 0, 0)
    if rank >= world:
        raise ConfigError(f"The environment variable RANK={rank} must be below WORLD_SIZE={world}.")
    if "LOCAL_WORLD_SIZE" in os.environ and local_rank >= local_world:
        raise ConfigError(
            f"The environment variable LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_world}."
        )
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k, "").strip()]
        if missing:
            raise ConfigError(
                f"WORLD_SIZE={world} asks for {world} processes, but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: the processes cannot find each other. Start "
                "them with torchrun (which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), or unset "
                "WORLD_SIZE to run in one process."
            )
        port = env_int("MASTER_PORT", 0, 1)
        if port > 65535:
            raise ConfigError(f"The environment variable MASTER_PORT={port} must be a TCP port (1 to 65535).")
    return LaunchEnv(rank, local_rank, world, local_world, node_rank)


def raise_on_every_rank(error: LmforgeError | None) -> None:
    """A collective: when any rank found an error in a check only it makes (rank 0's output checks, a
    file only one node sees), the lowest such rank raises its error and every other rank raises
    :class:`ReportedByAnotherRank` (the CLI exits 2 without printing it again), instead of running into
    the next collective and dying with the transport's "connection closed" tracebacks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if error is None else str(error))
    failing = [r for r, message in enumerate(found) if message is not None]
    if not failing:
        return
    if error is not None and dist.get_rank() == failing[0]:
        raise error
    # torchrun ends the remaining workers as soon as one exits: the reporting rank exits first, so its
    # message is printed before the launcher's SIGTERM can reach it.
    time.sleep(QUIET_RANK_GRACE_S)
    raise ReportedByAnotherRank(f"rank {failing[0]} stopped the job: {found[failing[0]]}")


def restart_count() -> int:
    """How many times this job was restarted (0 on the first attempt); the same on every rank.

    Under torchrun's shared store this is the store generation minus one: every attempt of the job,
    on every node, takes one. ``TORCHELASTIC_RESTART_COUNT`` is only the fallback (before the process
    group exists, or without the shared store): on a multi-node job it counts only the restarts of
    the node whose worker failed, so ranks on other nodes would disagree about resuming.
    """
    if _generation is not None:
        return _generation - 1
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def is_elastic_restart() -> bool:
    return restart_count() > 0


def init_process_group(backend: str, rank: int, world_size: int, timeout_s: float) -> dist.Store | None:
    """``dist.init_process_group`` from torchrun's environment; returns the store it was built on.

    Under torchrun's shared store the group is built on a fresh generation of it (see the module
    docstring); otherwise torch's ``env://`` rendezvous is used as is (rank 0 then hosts a new
    store each time, which holds no stale keys).
    """
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
        return None
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    global _generation
    generation = agree_generation(base, rank, world_size, timeout_s)
    _generation = generation
    store = dist.PrefixStore(f"{NAMESPACE}/gen{generation}/", base)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return store


def agree_generation(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> int:
    """A number that every rank of this attempt gets and no rank of an earlier attempt had.

    Rank 0's cost is one store round trip per joining rank (plus one per nonce of earlier attempts
    still queued): every other rank appends its nonce to a queue (an atomic counter plus one key per
    entry), rank 0 answers the queue in order and counts the ranks that took their answer.
    """
    if world_size == 1:
        return store.add(f"{NAMESPACE}/generation", 1)
    if rank != 0:
        nonce = uuid.uuid4().hex
        slot = store.add(f"{NAMESPACE}/queue_len", 1)
        store.set(f"{NAMESPACE}/queue/{slot}", nonce)
        try:
            generation = int(store.get(f"{NAMESPACE}/ack/{nonce}"))  # blocks up to the store's timeout
        except Exception as exc:  # torch raises DistStoreError (a RuntimeError) on its timeout
            raise DistributedStartError(
                f"rank {rank}: rank 0 did not answer within parallelism.process_group_timeout "
                f"({timeout_s:g} s) during start-up (phase: rendezvous). Check that rank 0 started "
                f"and can reach MASTER_ADDR={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}."
            ) from exc
        store.add(f"{NAMESPACE}/ready/{generation}", 1)
        return generation
    generation = store.add(f"{NAMESPACE}/generation", 1)
    answered = 0  # queue entries answered; earlier attempts' entries are answered too (harmless)
    deadline = time.monotonic() + timeout_s
    while store.add(f"{NAMESPACE}/ready/{generation}", 0) < world_size - 1:
        queued = store.add(f"{NAMESPACE}/queue_len", 0)
        while answered < queued:
            answered += 1
            nonce = store.get(f"{NAMESPACE}/queue/{answered}").decode()  # set right after the slot is taken
            store.set(f"{NAMESPACE}/ack/{nonce}", str(generation))
        if time.monotonic() > deadline:
            joined = store.add(f"{NAMESPACE}/ready/{generation}", 0)
            raise DistributedStartError(
                f"rank 0: only {joined} of the {world_size - 1} other ranks joined within "
                f"parallelism.process_group_timeout ({timeout_s:g} s) during start-up (phase: rendezvous). "
                f"Check that every node started (torchrun --nnodes) and can reach MASTER_ADDR."
            )
        time.sleep(0.01)
    return generation

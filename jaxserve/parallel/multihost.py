"""Several hosts, one engine: process 0 schedules, every process runs the same step.

JAX is multi-controller: on a TPU pod slice or a multi-node GPU cluster each host runs
its own Python process, and a jitted function over a mesh that spans hosts runs only if
every process calls it, in the same order, with the same inputs. The scheduler, the
prefix cache and the server are plain Python and live on process 0 alone; the others
are followers::

    process 0 (leader)                         process i > 0 (follower)
    server -> scheduler -> runner.execute      runner.follow():
       announce(STEP, T, S) ───────────────>      header = receive()
       broadcast(md, sampling_md) ─────────>      md, smd = receive(shape of bucket T, S)
       step(state, kv, md, smd)                    step(state, kv, md, smd)
       (sampled tokens come back on all; only process 0 reads them)

The broadcast is ``multihost_utils.broadcast_one_to_all`` (a collective over every
device, so it rides the same interconnect as the model). A header of four int32
(operation, token bucket, sequence bucket, whether the step has penalties) goes first, because followers must know the
shapes of what they receive; the packed batch follows. Page copies (prefix-cache
copy-on-write) are announced the same way, and ``stop`` ends the followers' loop.

Set-up: ``distributed: {coordinator_address: host:port, num_processes: N, process_id: i}``
in the engine config (or ``distributed: auto`` where JAX detects the cluster, e.g. TPU
pods), the same config on every host except ``process_id``; ``jaxserve run`` on process 0
serves, on the others it follows.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils

STEP, COPY_PAGES, STOP = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """``distributed:`` from the engine config; ``auto`` lets JAX find the cluster."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False

    @classmethod
    def from_option(cls, value) -> DistributedConfig | None:
        """Parses the config value; raises ValueError naming the key and allowed values."""
        if value is None:
            return None
        if value == "auto":
            return cls(auto=True)
        keys = {"coordinator_address", "num_processes", "process_id"}
        if not isinstance(value, dict) or set(value) != keys:
            raise ValueError(
                f"distributed = {value!r}: must be 'auto' or a mapping with exactly the keys "
                f"coordinator_address (host:port), num_processes, process_id"
            )
        address, n, pid = value["coordinator_address"], value["num_processes"], value["process_id"]
        if not isinstance(address, str) or ":" not in address:
            raise ValueError(f"distributed.coordinator_address = {address!r}: must be 'host:port'")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"distributed.num_processes = {n!r}: must be an integer >= 1")
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < n:
            raise ValueError(f"distributed.process_id = {pid!r}: must be an integer in [0, {n - 1}]")
        return cls(address, n, pid)


def initialize(cfg: DistributedConfig) -> None:
    """Joins the cluster (once per process, before any other JAX call)."""
    if jax.distributed.is_initialized():
        return
    if jax.config.jax_platforms in (None, "", "cpu"):
        # CPU processes (tests, development) exchange collectives through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cfg.auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes, process_id=cfg.process_id)


class StepChannel:
    """Process 0's calls on the jitted functions, replayed on every process."""

    def announce(self, op: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        """Leader: what comes next (and the shapes followers must prepare for)."""
        multihost_utils.broadcast_one_to_all(np.asarray([op, a, b, c], np.int32))

    def next_op(self) -> tuple[int, int, int, int]:
        """Follower: waits for the leader's next announcement."""
        op, a, b, c = multihost_utils.broadcast_one_to_all(np.zeros(4, np.int32))
        return int(op), int(a), int(b), int(c)

    @staticmethod
    def share(tree):
        """Leader: sends ``tree``; follower: pass a same-shaped template, get the leader's."""
        return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated result as numpy, also when the array spans other processes' devices."""
    return np.asarray(x) if x.is_fully_addressable else np.asarray(x.addressable_data(0))

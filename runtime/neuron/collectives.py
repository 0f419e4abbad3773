"""Where the ranks' in-NEFF collectives meet (NEURON_RT_ROOT_COMM_ID), and the bound on waiting there.

A trn2 bundle whose executables hold collectives (fused layers, or `reduced` in the manifest) needs
libnrt's collectives, and libnrt finds the other ranks through NEURON_RT_ROOT_COMM_ID=<ip>:<port>:
mandatory for such NEFFs, the same on every rank, and unrelated to the gloo process group (its own
port). `prepare` runs on every rank after the process group is joined and before anything is loaded:
the leader picks the address (or the one the user set is kept, once every rank is seen to hold the
same), every rank sets it in its environment before libnrt starts, and the rank's collective libnrt
calls are bounded by an `arrival.ArrivalWatch` over the store the ranks share. Other bundles (cpu,
collectives on the host, one rank) change nothing.

The address: the leader's host as the other ranks reach it (127.0.0.1 for ranks this process
started on this host; MASTER_ADDR under torchrun) and a port the OS reports free on the leader. The
port is released before libnrt binds it, so another program could take it in between; the same holds
for every launcher that picks one (a user who needs a fixed one sets the variable).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist

from deepinfer.bundles.manifest import Manifest
from deepinfer.errors import DeepinferError
from deepinfer.runtime.neuron import arrival
from deepinfer.runtime.neuron.libnrt import ENV_ROOT_COMM

LOCAL_HOST = "127.0.0.1"  # ranks started by this process, on this host


class RootCommError(DeepinferError):
    """NEURON_RT_ROOT_COMM_ID is malformed or not the same on every rank."""


def in_graph_collectives(manifest: Manifest) -> bool:
    """Whether the bundle's NEFFs hold collectives (trn2 with several ranks: fused layers, or a region's
    boundary all-reduce with `collectives = "graph"`)."""
    return (
        manifest.target.name == "trn2"
        and manifest.topology.world_size > 1
        and any(e.holds_collectives for e in manifest.regions)
    )


def prepare(
    manifest: Manifest,
    rank: int,
    store,
    *,
    host: str,
    timeout_s: float,
    report: Callable[[arrival.CollectiveTimeout], None] | None = None,
) -> None:
    """On every rank, in its process group, before the bundle is loaded: for a bundle with collectives
    in its NEFFs, agree on NEURON_RT_ROOT_COMM_ID (`share_root_comm`, the leader's address `host`) and
    bound this rank's collective libnrt calls by `timeout_s` (`report`: where the error goes before
    the process ends; default stderr). Any other bundle: no watch, nothing set."""
    arrival.install(None)
    if not in_graph_collectives(manifest):
        return
    world = manifest.topology.world_size
    share_root_comm(rank, world, host)
    arrival.install(arrival.ArrivalWatch(store, rank, world, timeout_s, report=report))


def share_root_comm(rank: int, world: int, host: str) -> str:
    """Every rank's NEURON_RT_ROOT_COMM_ID, the same: the value the user set (checked equal on every
    rank over the process group, and well formed), else one the leader picks (`choose_root_comm`) and
    broadcasts. Sets it in this process's environment and returns it."""
    mine = os.environ.get(ENV_ROOT_COMM) or None
    values: list[str | None] = [None] * world
    dist.all_gather_object(values, mine)
    users = {v for v in values if v is not None}
    if users:
        if len(set(values)) > 1:
            held = ", ".join(f"{v or 'unset'} on {arrival.rank_spans(rs)}" for v, rs in _by_value(values).items())
            raise RootCommError(
                f"{ENV_ROOT_COMM} differs between the ranks ({held}); set the same <ip>:<port> on every "
                "rank, or unset it on all and the leader picks one"
            )
        chosen = _check_address(users.pop())
    else:
        box = [choose_root_comm(host) if rank == 0 else ""]
        dist.broadcast_object_list(box, src=0)
        chosen = box[0]
    os.environ[ENV_ROOT_COMM] = chosen
    return chosen


def choose_root_comm(host: str) -> str:
    """`host`:<a port free on this host now>, not torchrun's MASTER_PORT (the process group's store)."""
    taken = {int(os.environ["MASTER_PORT"])} if os.environ.get("MASTER_PORT", "").isdigit() else set()
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return f"{host}:{port}"


def _check_address(value: str) -> str:
    address, _, port = value.rpartition(":")
    if not address or not port.isdigit() or not 0 < int(port) < 65536:
        raise RootCommError(f"{ENV_ROOT_COMM}={value} is not <ip>:<port>; set one address every rank reaches")
    return value


def _by_value(values: list) -> dict:
    """{value: [ranks holding it]}, in rank order of first appearance."""
    out: dict = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    return out

"""Where each rank's peer replicas live (Checkpointer(memory=True, replicas=k)): which node a rank
is on, and which ranks hold a rank's memory copies, never on the rank's own node.

A node is a failure domain: the host whose memory (and local disk) goes when it goes. A rank's
node is `node=` where given, else torchrun's GROUP_RANK, else rank // LOCAL_WORLD_SIZE, else the
host name, each with the memory root (GDSCKPT_MEMORY_ROOT): ranks of one host given memory roots
of their own count as nodes of their own (how tests simulate nodes on one machine), with a
warning where a replica then lands on its rank's own host. Every rank's is gathered once, when
the Checkpointer is made (a collective already).

The default placement is a ring over the nodes, in the order of their first rank: rank r, the
i-th rank of node n, sends its copies to the i-th rank (i modulo its rank count) of nodes n+1,
..., n+k (modulo the node count). With one rank per node that is rank r -> r+1, ..., r+k. So
each node's replicas are spread over k other nodes, and a node holds the replicas of the k
nodes before it: a node lost costs nothing; a node and the next one lost together costs the
first one's newest steps from memory (its ranks fall back, all ranks with them, to the disk).

A mapping {rank: [holder ranks]} replaces the ring (racks, say: holders in another rack); it is
refused (ReplicaPlacementError naming the ranks) where a holder is the rank's own node, not a
rank of the world, or missing for a rank.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping, Sequence

from gdsckpt.errors import ReplicaPlacementError


def local_node() -> str:
    """This process's node: torchrun's GROUP_RANK, else rank // LOCAL_WORLD_SIZE, else the host
    name; then the memory root it keeps its copies in."""
    from gdsckpt.manager.memory.folders import memory_root
    group = os.environ.get("GROUP_RANK")
    local = os.environ.get("LOCAL_WORLD_SIZE")
    rank = os.environ.get("RANK")
    if group not in (None, ""):
        base = f"group-{group}"
    elif local and rank and local.isdigit() and rank.isdigit() and int(local) > 0:
        base = f"group-{int(rank) // int(local)}"
    else:
        base = f"host-{socket.gethostname()}"
    return f"{base}:{os.path.realpath(memory_root())}"


def gather_nodes(node, group=None) -> tuple[list[str], list[str]]:
    """Every rank's node and host name (a collective on `group`: every rank calls it), rank by rank."""
    import torch.distributed as dist
    mine = (str(node) if node is not None else local_node(), socket.gethostname())
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return [str(n) for n, _ in every], [str(h) for _, h in every]


def same_host(placement: Mapping[int, Sequence[int]], hosts: Sequence[str]) -> list[tuple[int, int]]:
    """(rank, holder) pairs of `placement` on one host: nodes told apart by their memory roots
    (or node=) alone, which a process's loss does not take together and the host's does."""
    return [(r, h) for r, holders in placement.items() for h in holders if hosts[r] == hosts[h]]


def ring(nodes: Sequence[str], replicas: int) -> dict[int, list[int]]:
    """{rank: [holder ranks]}: the default placement over `nodes` (each rank's node)."""
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in members:
            order.append(node)
            members[node] = []
        members[node].append(rank)
    if replicas >= len(order):
        raise ReplicaPlacementError(
            f"replicas={replicas} needs {replicas + 1} nodes (failure domains), and the ranks are on "
            f"{len(order)} ({_nodes_named(order)}): a replica on a rank's own node does not outlive the node. "
            "Pass node= (or run under torchrun with several nodes), or replicas=0")
    out = {}
    for n, node in enumerate(order):
        for i, rank in enumerate(members[node]):
            out[rank] = [members[order[(n + k) % len(order)]][i % len(members[order[(n + k) % len(order)]])]
                         for k in range(1, replicas + 1)]
    return out


def checked(mapping: Mapping, nodes: Sequence[str], replicas: int) -> dict[int, list[int]]:
    """A placement passed as {rank: [holder ranks]}: every rank given `replicas` holders, each a
    rank of the world on another node, none twice (ReplicaPlacementError naming the ranks)."""
    world = len(nodes)
    out: dict[int, list[int]] = {}
    for rank in range(world):
        holders = mapping.get(rank, mapping.get(str(rank)))
        if holders is None:
            raise ReplicaPlacementError(f"placement= names no holder for rank {rank} (every rank of the {world} "
                                        "needs its own)")
        holders = [int(h) for h in ([holders] if isinstance(holders, int) else holders)]
        if len(holders) != replicas or len(set(holders)) != len(holders):
            raise ReplicaPlacementError(f"placement= gives rank {rank} holders {holders}: replicas={replicas} "
                                        f"needs {replicas} distinct ones")
        for h in holders:
            if not 0 <= h < world:
                raise ReplicaPlacementError(f"placement= gives rank {rank} holder rank {h}, not a rank of the "
                                            f"world of {world}")
            if nodes[h] == nodes[rank]:
                raise ReplicaPlacementError(
                    f"placement= puts rank {rank}'s replica on rank {h}, on the same node ({nodes[rank]!r}): "
                    "it would go with the node it is meant to outlive")
        out[rank] = holders
    extra = sorted(set(map(int, mapping)) - set(range(world)))
    if extra:
        raise ReplicaPlacementError(f"placement= names rank(s) {extra}, not ranks of the world of {world}")
    return out


def place(nodes: Sequence[str], replicas: int, mapping: Mapping | None = None) -> dict[int, list[int]]:
    """{rank: [holder ranks]} for every rank: the mapping checked, or the ring."""
    if mapping is not None:
        return checked(mapping, nodes, replicas)
    return ring(nodes, replicas)


def held_for(placement: Mapping[int, Sequence[int]], rank: int) -> list[int]:
    """The ranks whose copies `rank` holds, in rank order."""
    return sorted(origin for origin, holders in placement.items() if rank in holders)


def _nodes_named(order: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in order[:4])
    return shown + (", ..." if len(order) > 4 else "")

"""Build the training and rollout ParallelCtx of this rank from the topology and its groups.

Adds what only the model config knows: the groups of TP ranks that replicate one KV head (when
TP exceeds the KV heads), and how token reductions are finished (distributed/tokensum.py): the
training context carries the policy's GradSink (its accumulators summed over DP × CP, or over the
world for SP-sharded norm weights and Q/K-norm head sums).
Collective: every rank calls it, in the same order (torch creates groups collectively).
"""

from __future__ import annotations

from rlkernel.distributed.comm import Comm
from rlkernel.distributed.parallel import ParallelCtx
from rlkernel.distributed.tokensum import GradSink, TokenSum
from rlkernel.distributed.topology import Comms, Topology
from rlkernel.model.config import Qwen3Config
from rlkernel.model.sharding import kv_replicas


def _kv_comms(tp_groups: list[tuple[int, ...]], rep: int, rank: int, name: str) -> Comm:
    """Comm of the `rep` consecutive ranks (inside each TP group) that share this rank's KV head."""
    import torch.distributed as dist

    mine = Comm.single(name)
    for ranks in tp_groups:
        for i in range(0, len(ranks), rep):
            sub = ranks[i:i + rep]
            group = dist.new_group(list(sub)) if len(sub) > 1 else None
            if rank in sub:
                mine = Comm(name, group, sub, sub.index(rank))
    return mine


def build_contexts(topo: Topology, comms: Comms, cfg: Qwen3Config) -> tuple[ParallelCtx, ParallelCtx]:
    """(training ctx, rollout ctx) of this rank."""
    groups = topo.groups()
    train_kv = _kv_comms(groups["tp"], kv_replicas(cfg, topo.tp), topo.rank, "kv")
    roll_kv = _kv_comms(groups["rollout_tp"], kv_replicas(cfg, topo.rollout_tp), topo.rank,
                        "rollout_kv")
    sink = GradSink({"dp_cp": comms.dp_cp, "world": comms.world})
    tok = TokenSum(comms.cp, "dp_cp", sink)
    # Under SP the TP ranks hold different tokens too: norm weights sum over the whole world.
    tok_sp = TokenSum(comms.tp_cp, "world", sink) if topo.sp else tok
    train = ParallelCtx(comms.tp, train_kv, comms.cp, topo.sp, tok, tok_sp, comms.dp)
    roll_tok = TokenSum(comms.rollout_cp)
    rollout = ParallelCtx(comms.rollout_tp, roll_kv, comms.rollout_cp, False, roll_tok, roll_tok)
    return train, rollout

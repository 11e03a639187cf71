"""The one topology object: parallel degrees, rank layouts, their validation, and the groups.

Training layout (world = dp * tp * cp): TP is the inner, contiguous dimension, DP the outer,

    rank = dp_rank * tp * cp + cp_rank * tp + tp_rank
    e.g. dp 2, tp 2, cp 1: TP groups (0,1) (2,3), DP groups (0,2) (1,3); tp 2, cp 2: TP groups
    (0,1) (2,3), CP groups (0,2) (1,3)

Each DP replica (tp * cp consecutive ranks) trains on its share of a mini-batch's samples; its
weight-gradient accumulators are summed over the DP × CP ranks with the same tp_rank ("dp_cp") or
over the world (distributed/tokensum.py), and AdamW state is sharded over "dp" (train/zero.py).

Rollout layout, on the same processes: ranks are cut into world // (rollout_tp * rollout_cp)
rollout data-parallel replicas of consecutive ranks; inside replica g,

    rank = g * rollout_tp * rollout_cp + rollout_cp_rank * rollout_tp + rollout_tp_rank

Every Comm lists its global ranks in layout order, so "rank order" of a collective is the logical
order that the canonical trees and all-gathers rely on (rlkernel/distributed/comm.py).

`validate_topology` is the single place where degrees are checked against the canonical spec, the
model's head counts and the world size (STYLE.md §5); each message names the flag, the value and
what is allowed. `build_comms` creates every process group in one fixed order on every rank.

Does not: start processes (rlkernel/distributed/launch.py) or shard a model. Imports no torch at module
level, so the CLI can validate a topology before paying for torch.
Tests: `.venv/bin/python -m pytest -q tests/test_dist.py`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlkernel.config import ConfigError
from rlkernel.spec import VIRTUAL_CP, VIRTUAL_DP, VIRTUAL_TP

if TYPE_CHECKING:
    from rlkernel.distributed.comm import Comm


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The env:// variables that mark a process started by torchrun (or another env:// launcher)."""


SHARE_GPUS_ENV = "RLK_SHARE_GPUS"
"""Set to 1: CUDA ranks share the visible GPUs round robin, CUDA tensors over gloo — a
validation mode (rlkernel/distributed/launch.py's module doc)."""
RANKS_PER_SHARED_GPU = 8
"""Most ranks `rlk run` starts on one GPU when they share it."""


def gpus_shared() -> bool:
    """Whether RLK_SHARE_GPUS asks CUDA ranks to share GPUs ("1"; unset, "" or "0": no).
    Raises ConfigError for any other value."""
    value = os.environ.get(SHARE_GPUS_ENV, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"{SHARE_GPUS_ENV}={value!r}: allowed are 1 (CUDA ranks share the "
                          "visible GPUs, CUDA tensors over gloo; validation only) or 0 / unset")
    return value == "1"


DIST_TIMEOUT_ENV = "RLK_DIST_TIMEOUT_S"
"""Seconds every collective wait and the rendezvous of a multi-rank run may take (default
300): past it the ranks are stopped and the one that did not arrive is named."""
DIST_TIMEOUT_RANGE = (1.0, 604800.0)
"""Allowed RLK_DIST_TIMEOUT_S: a second (below it the rendezvous itself times out) to a week
(past it the timeout no longer stops a hung rank in any useful time)."""


def dist_timeout_s() -> float:
    """RLK_DIST_TIMEOUT_S in seconds (300 when unset or empty). Raises ConfigError, naming the
    variable, its value and the allowed range, for anything but a number in
    DIST_TIMEOUT_RANGE."""
    text = os.environ.get(DIST_TIMEOUT_ENV, "").strip()
    if not text:
        return 300.0
    lo, hi = DIST_TIMEOUT_RANGE
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not lo <= value <= hi:
        raise ConfigError(f"{DIST_TIMEOUT_ENV}={os.environ[DIST_TIMEOUT_ENV]!r}: must be a "
                          f"number of seconds in [{lo:g}, {hi:g}] (or unset: 300)")
    return value


def launcher_world_size() -> int | None:
    """WORLD_SIZE when this process was started by torchrun (all TORCHRUN_VARS set), else None.

    Raises ConfigError when WORLD_SIZE is not a positive integer.
    """
    if not all(v in os.environ for v in TORCHRUN_VARS):
        return None
    text = os.environ["WORLD_SIZE"]
    try:
        world = int(text)
    except ValueError:
        world = 0
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={text!r} (from the launcher's environment): must be an "
                          "integer >= 1")
    return world


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _join(xs: list[int]) -> str:
    return ", ".join(str(x) for x in xs) if xs else "none"


def _tp_problem(t: int, heads: int | None, kv_heads: int | None, vocab_size: int | None,
                intermediate_size: int | None) -> str | None:
    """Why TP degree `t` cannot shard this model (None: it can). Assumes t divides VIRTUAL_TP."""
    if heads is not None and heads % t:
        return f"must divide num_attention_heads={heads} (each rank computes whole heads)"
    if kv_heads is not None:
        if kv_heads < t and t % kv_heads:
            return (f"must be a multiple of num_key_value_heads={kv_heads} when larger than it "
                    "(KV heads are replicated whole across TP ranks)")
        if kv_heads >= t and kv_heads % t:
            return f"must divide num_key_value_heads={kv_heads} (each rank holds whole KV heads)"
    if vocab_size is not None and vocab_size % t:
        return f"must divide vocab_size={vocab_size} (vocab-parallel embedding and LM head)"
    if intermediate_size is not None and intermediate_size % t:
        return f"must divide intermediate_size={intermediate_size} (row-parallel down_proj)"
    return None


def _check_degree(flag: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{flag} {v!r}: must be an integer >= 1")
    return v


def validate_topology(tp: int, cp: int, sp: bool, rollout_tp: int, rollout_cp: int, *,
                      world: int | None, num_attention_heads: int | None = None,
                      num_key_value_heads: int | None = None, vocab_size: int | None = None,
                      intermediate_size: int | None = None, dp: int = 1) -> None:
    """Refuse a topology the canonical contract or the model cannot run. Raises ConfigError.

    world: the number of processes when it is imposed from outside (torchrun's WORLD_SIZE); None
    when rl-kernel starts dp * tp * cp processes itself. Model sizes are checked only when given.
    (That DP divides the samples of a mini-batch is checked by config.RunConfig, which knows them.)
    """
    for flag, v in (("--dp", dp), ("--tp", tp), ("--cp", cp), ("--rollout-tp", rollout_tp),
                    ("--rollout-cp", rollout_cp)):
        _check_degree(flag, v)
    if VIRTUAL_DP % dp:
        raise ConfigError(f"--dp {dp}: must divide virtual_dp={VIRTUAL_DP}; "
                          f"allowed: {_join(_divisors(VIRTUAL_DP))}")
    if not isinstance(sp, bool):
        raise ConfigError(f"--sp {sp!r}: must be a bool")
    model = (num_attention_heads, num_key_value_heads, vocab_size, intermediate_size)
    for flag, t in (("--tp", tp), ("--rollout-tp", rollout_tp)):
        if VIRTUAL_TP % t:
            raise ConfigError(f"{flag} {t}: must divide virtual_tp={VIRTUAL_TP}; "
                              f"allowed: {_join(_divisors(VIRTUAL_TP))}")
        problem = _tp_problem(t, *model)
        if problem:
            ok = [d for d in _divisors(VIRTUAL_TP) if _tp_problem(d, *model) is None]
            raise ConfigError(f"{flag} {t}: {problem}; allowed for this model: {_join(ok)}")
    for flag, c in (("--cp", cp), ("--rollout-cp", rollout_cp)):
        if VIRTUAL_CP % c:
            raise ConfigError(f"{flag} {c}: must divide virtual_cp={VIRTUAL_CP}; "
                              f"allowed: {_join(_divisors(VIRTUAL_CP))}")
    if sp and tp == 1:
        raise ConfigError("--sp (with --tp 1): sequence parallelism splits sequences across the "
                          "TP group, so it needs --tp > 1; allowed: --sp with --tp 2, 4 or 8, "
                          "or leave out --sp")
    train = dp * tp * cp
    if world is not None and world != train:
        reachable = VIRTUAL_DP * VIRTUAL_TP * VIRTUAL_CP % world == 0   # degrees divide 8 each
        fix = (f"choose --dp, --tp and --cp whose product is {world}" if reachable else
               f"start a number of processes that is a product of allowed degrees (--dp, --tp, "
               f"--cp each divide 8, so a power of two up to "
               f"{VIRTUAL_DP * VIRTUAL_TP * VIRTUAL_CP}); {world} is not")
        raise ConfigError(f"WORLD_SIZE={world} but --dp {dp} × --tp {tp} × --cp {cp} = {train}: "
                          f"the number of processes must equal the training world; start {train} "
                          f"processes, or {fix}")
    if train % (rollout_tp * rollout_cp):
        raise ConfigError(f"--rollout-tp {rollout_tp} × --rollout-cp {rollout_cp} = "
                          f"{rollout_tp * rollout_cp} must divide the training world --dp {dp} × "
                          f"--tp {tp} × --cp {cp} = {train} (rollout replicas run on the training "
                          f"processes); allowed products: {_join(_divisors(train))}")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Degrees and this process's place in the training and rollout layouts (see module doc)."""

    world: int
    """Processes in the job; equals dp * tp * cp."""
    rank: int
    """This process's global rank, in [0, world)."""
    dp: int = 1
    tp: int = 1
    cp: int = 1
    sp: bool = False
    rollout_tp: int = 1
    rollout_cp: int = 1

    def __post_init__(self) -> None:
        validate_topology(self.tp, self.cp, self.sp, self.rollout_tp, self.rollout_cp,
                          world=self.world, dp=self.dp)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) \
                or not 0 <= self.rank < self.world:
            raise ConfigError(f"rank {self.rank!r}: must be an integer in [0, {self.world})")

    @classmethod
    def from_config(cls, cfg, rank: int, world: int) -> "Topology":
        """The topology of a RunConfig (rlkernel/config.py) seen from `rank`."""
        return cls(world=world, rank=rank, dp=cfg.dp, tp=cfg.tp, cp=cfg.cp, sp=cfg.sp,
                   rollout_tp=cfg.rollout_tp, rollout_cp=cfg.rollout_cp)

    def at(self, rank: int) -> "Topology":
        """The same topology seen from another rank."""
        return dataclasses.replace(self, rank=rank)

    # ---- training layout
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return self.rank % (self.tp * self.cp) // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp)

    # ---- rollout layout
    @property
    def rollout_size(self) -> int:
        """Ranks of one rollout replica: rollout_tp * rollout_cp."""
        return self.rollout_tp * self.rollout_cp

    @property
    def rollout_dp(self) -> int:
        """Rollout data-parallel replicas: world // (rollout_tp * rollout_cp)."""
        return self.world // self.rollout_size

    @property
    def rollout_dp_rank(self) -> int:
        return self.rank // self.rollout_size

    @property
    def rollout_tp_rank(self) -> int:
        return self.rank % self.rollout_size % self.rollout_tp

    @property
    def rollout_cp_rank(self) -> int:
        return self.rank % self.rollout_size // self.rollout_tp

    # ---- group memberships (pure: every rank computes every group the same way)
    def groups(self) -> dict[str, list[tuple[int, ...]]]:
        """Every group of each kind, each as its global ranks in layout order.

        Key order and list order are the fixed creation order of build_comms. Every rank is in
        exactly one group of each kind.
        """
        tp, cp, dp, w = self.tp, self.cp, self.dp, self.world
        tc = tp * cp
        rs, rtp, rcp = self.rollout_size, self.rollout_tp, self.rollout_cp
        return {
            "world": [tuple(range(w))],
            "tp": [tuple(d * tc + c * tp + t for t in range(tp)) for d in range(dp)
                   for c in range(cp)],
            "cp": [tuple(d * tc + c * tp + t for c in range(cp)) for d in range(dp)
                   for t in range(tp)],
            "tp_cp": [tuple(range(d * tc, (d + 1) * tc)) for d in range(dp)],
            "rollout_tp": [tuple(g * rs + c * rtp + t for t in range(rtp))
                           for g in range(self.rollout_dp) for c in range(rcp)],
            "rollout_cp": [tuple(g * rs + c * rtp + t for c in range(rcp))
                           for g in range(self.rollout_dp) for t in range(rtp)],
            "rollout_dp": [tuple(g * rs + i for g in range(self.rollout_dp)) for i in range(rs)],
            "dp": [tuple(d * tc + c * tp + t for d in range(dp)) for c in range(cp)
                   for t in range(tp)],
            "dp_cp": [tuple(d * tc + c * tp + t for d in range(dp) for c in range(cp))
                      for t in range(tp)],
        }

    def group_ranks(self, kind: str) -> tuple[int, ...]:
        """The global ranks, in layout order, of this rank's group of `kind` (a groups() key)."""
        for ranks in self.groups()[kind]:
            if self.rank in ranks:
                return ranks
        raise AssertionError(f"rank {self.rank} is in no {kind} group")  # groups() covers all


@dataclass
class Comms:
    """This rank's Comm in each group kind (rank order = layout order, see module doc)."""

    world: Comm
    tp: Comm
    cp: Comm
    tp_cp: Comm
    """This rank's DP replica (tp * cp ranks)."""
    rollout_tp: Comm
    rollout_cp: Comm
    rollout_dp: Comm
    dp: Comm
    """The ranks with this rank's (tp_rank, cp_rank), one per DP replica."""
    dp_cp: Comm
    """The ranks with this rank's tp_rank: they hold the other tokens of a mini-batch."""

    def group(self, kind: str) -> Comm:
        """The Comm of a group kind by name ("tp", "rollout_cp", ...)."""
        if kind not in _KINDS:
            raise KeyError(f"no group kind {kind!r}; known: {', '.join(_KINDS)}")
        return getattr(self, kind)


_KINDS = tuple(f.name for f in dataclasses.fields(Comms))


def build_comms(topo: Topology) -> Comms:
    """Create every process group and return this rank's Comms. Collective: call on every rank.

    torch.distributed requires every rank to call new_group for every group, members or not, in
    the same order; groups are created kind by kind in Topology.groups() order. One-rank groups get
    no process group (a Comm of size 1 never communicates). "world" is the default group.
    The default process group must be initialised (rlkernel/distributed/launch.py does it).
    """
    import torch.distributed as dist

    from rlkernel.distributed.comm import Comm

    if dist.get_world_size() != topo.world or dist.get_rank() != topo.rank:
        raise ConfigError(f"process group has rank {dist.get_rank()} of {dist.get_world_size()} "
                          f"but the topology says rank {topo.rank} of {topo.world}")
    mine: dict[str, Comm] = {}
    for kind, all_ranks in topo.groups().items():
        for ranks in all_ranks:
            if len(ranks) == 1:
                group = None
            elif kind == "world":
                group = dist.group.WORLD
            else:
                # torch numbers a group's members in ascending global rank; Comm's rank order must
                # be the same, which every layout above satisfies.
                assert list(ranks) == sorted(ranks), (kind, ranks)
                group = dist.new_group(list(ranks))
            if topo.rank in ranks:
                mine[kind] = Comm(kind, group, ranks, ranks.index(topo.rank))
    return Comms(**mine)


def single_comms() -> Comms:
    """Comms of a one-process run: every group is Comm.single()."""
    from rlkernel.distributed.comm import Comm

    return Comms(**{k: Comm.single(k) for k in _KINDS})

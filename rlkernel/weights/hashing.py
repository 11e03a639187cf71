"""Content hashes of logical tensors and of whole weight versions (DESIGN.md §4).

`tensor_hash` is SHA-256 over a small header (dtype, shape) and the tensor's raw bytes, so two
tensors hash equal exactly when they have the same dtype, the same shape and the same bits: no
float conversion, so NaN payloads, -0.0 and bf16 patterns all count. `version_hash` folds the
per-tensor hashes of one weight version into a Merkle root; `compare_hashes` says, tensor by
tensor, why two versions differ. `state_hashes(tensors, comm)` splits the chunk digests of a
logical state over the ranks that all hold it (the weight sync: every rank holds the export) and
gives every rank the serial result.

Does not: load, save or shard weights (rlkernel/model/checkpoint.py does), and does not decide
which tensors are "logical" (param_shapes in rlkernel/model/config.py does). Hashes are of the
bytes as stored in host memory, which is little-endian on every platform rl-kernel runs on.
Test: `python -m pytest -q tests/test_checkpoint.py tests/test_sync.py`.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

# Bumped if the byte layout hashed below ever changes, so old and new hashes can never match.
_TENSOR_HASH_DOMAIN = b"rlk-tensor-v2\0"
HASH_CHUNK_BYTES = 8 << 20
"""A tensor's bytes are digested in chunks of this many bytes (the last may be shorter), so one
large tensor (an embedding) hashes on many cores and a GPU tensor streams to the host in pieces."""
_HASH_THREADS = max(1, min(32, os.cpu_count() or 1))


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` as a flat uint8 tensor of its row-major bytes, on t's device (a contiguous copy only
    when t is not contiguous). Raises ValueError for sparse or quantized tensors."""
    if t.layout != torch.strided or t.is_quantized:
        raise ValueError(f"tensor_hash: only dense (strided) tensors can be hashed, got layout "
                         f"{t.layout} {'(quantized)' if t.is_quantized else ''}".rstrip())
    # resolve_conj/resolve_neg: lazily conjugated/negated views must hash as what they read as.
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    # reshape(-1) makes 0-d tensors 1-d so the uint8 view is legal; no copy for contiguous input.
    return t.reshape(-1).view(torch.uint8)


# Integer dtypes of each element size: a same-size view compares bit patterns, never float values.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` have the same dtype, shape and bits, i.e. would hash equal.

    Compares bit patterns (NaN payloads, -0.0 vs 0.0 and bf16 patterns count), not float values;
    strides and storage offsets do not count. Both must be on one device. Raises ValueError for
    sparse, quantized or complex tensors (no single integer view of their bits).
    """
    for t in (a, b):
        if t.layout != torch.strided or t.is_quantized or t.is_complex():
            raise ValueError(f"same_bytes: only dense real tensors, got {t.dtype} {t.layout}")
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    bits = _BITS[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


def _header(t: torch.Tensor) -> bytes:
    return (_TENSOR_HASH_DOMAIN + str(t.dtype).removeprefix("torch.").encode() + b"\0"
            + ",".join(str(s) for s in t.shape).encode() + b"\0"
            + str(HASH_CHUNK_BYTES).encode() + b"\0")


def _chunk_spans(n_bytes: int) -> list[tuple[int, int]]:
    return [(a, min(a + HASH_CHUNK_BYTES, n_bytes)) for a in range(0, n_bytes, HASH_CHUNK_BYTES)]


def _chunk_digest(flat: torch.Tensor, span: tuple[int, int]) -> bytes:
    """SHA-256 of flat[a:b] (uint8), copied to the host first when it lives on a GPU."""
    piece = flat[span[0]:span[1]]
    if piece.device.type != "cpu":
        piece = piece.cpu()
    return hashlib.sha256(memoryview(piece.numpy()).cast("B")).digest()


def tensor_hash(t: torch.Tensor) -> str:
    """Hex SHA-256 of one tensor: equal iff dtype, shape and every byte are equal.

    Definition (a two-level SHA-256, so chunks can be digested in parallel):
      chunk digests: the raw element bytes in row-major order (`Tensor.view(torch.uint8)`,
        never a float conversion, so NaN payloads, -0.0 and bf16 patterns count) cut into chunks
        of HASH_CHUNK_BYTES (8 MiB; the last may be shorter; none for an empty tensor), each
        digested with SHA-256 (32 raw bytes);
      tensor hash: SHA-256 of b"rlk-tensor-v2\\0", the dtype name without "torch."
        (e.g. b"bfloat16") + b"\\0", the shape as decimal sizes joined by "," (b"" for a 0-d
        tensor) + b"\\0", the chunk size in decimal + b"\\0", then the chunk digests in order.
    The header makes a dtype or shape change (same bytes, e.g. a bf16 tensor viewed as int16, or
    a reshape) change the hash. Device, strides, requires_grad and storage offset do not count.

    Args: t: any dense tensor, any device, any dtype, any shape (non-contiguous is fine).
    Returns: 64 lowercase hex characters.
    Raises: ValueError for sparse or quantized tensors.
    """
    return state_hashes({"": t})[""]


def state_hashes(tensors: dict[str, torch.Tensor], comm=None) -> dict[str, str]:
    """`tensor_hash` of every tensor, keeping the dict's (canonical) order.

    Every chunk of every tensor is digested on one thread pool (hashlib releases the GIL while it
    digests a buffer, and a GPU chunk's copy to the host runs inside its task), so a model's
    weights hash at about cores × one core's SHA-256 rate whatever the size of its largest
    tensor; the results do not depend on the scheduling, each digest being a pure function of
    its own chunk.

    `comm` (a rlkernel.distributed.comm.Comm whose every rank holds these same tensors: same
    names, order, dtypes, shapes and bytes) splits the work: the chunks of all tensors are
    numbered in order (tensor by tensor, chunk by chunk), rank r digests the chunks i with
    i % comm.size == r, and one all_gather_object of the 32-byte digests gives every rank every
    digest, so every rank returns the same dict, bit for bit the serial one. Collective over
    `comm`: call on every rank. The ranks' bytes are not compared (each chunk is read on one
    rank only); names, dtypes and shapes are, and ValueError (on every rank alike) names a rank
    whose layout or digest count differs.
    """
    flats = {name: _flat_bytes(t) for name, t in tensors.items()}
    tasks = [(name, span) for name, flat in flats.items() for span in _chunk_spans(flat.numel())]
    if comm is None or comm.size == 1:
        digests = _digest_tasks(flats, tasks)
    else:
        digests = _split_digests(tensors, flats, tasks, comm)
    per_tensor: dict[str, list[bytes]] = {name: [] for name in tensors}
    for (name, _), d in zip(tasks, digests):
        per_tensor[name].append(d)
    return {name: hashlib.sha256(_header(t) + b"".join(per_tensor[name])).hexdigest()
            for name, t in tensors.items()}


def _digest_tasks(flats: dict[str, torch.Tensor],
                  tasks: list[tuple[str, tuple[int, int]]]) -> list[bytes]:
    """The chunk digest of every (tensor name, byte span) task, in order (a thread pool)."""
    if len(tasks) < 2:
        return [_chunk_digest(flats[n], span) for n, span in tasks]
    with ThreadPoolExecutor(max_workers=min(len(tasks), _HASH_THREADS)) as pool:
        return list(pool.map(lambda task: _chunk_digest(flats[task[0]], task[1]), tasks))


def _my_tasks(tasks: list, rank: int, size: int) -> list:
    """The tasks rank `rank` of `size` digests: every size-th, from its own rank on."""
    return tasks[rank::size]


def _split_digests(tensors: dict[str, torch.Tensor], flats: dict[str, torch.Tensor],
                   tasks: list[tuple[str, tuple[int, int]]], comm) -> list[bytes]:
    """Every task's digest, this rank having digested its share (state_hashes with a comm)."""
    # What the task list depends on (names, dtypes, shapes): equal on every rank, or the
    # digests would be interleaved into hashes of tensors nobody holds.
    layout = hashlib.sha256(b"".join(name.encode() + b"\0" + _header(t)
                                     for name, t in tensors.items())).hexdigest()
    mine = _digest_tasks(flats, _my_tasks(tasks, comm.rank, comm.size))
    parts = comm.all_gather_object((layout, b"".join(mine)), "hash-chunk-digests")
    for r, (their_layout, blob) in enumerate(parts):   # the same checks on every rank
        if their_layout != parts[0][0]:
            raise ValueError(f"state_hashes: rank {comm.ranks[r]} of {comm.name} holds other "
                             f"tensors (names, dtypes or shapes) than rank {comm.ranks[0]}")
        want = len(range(r, len(tasks), comm.size))
        if len(blob) != 32 * want:
            raise ValueError(f"state_hashes: rank {comm.ranks[r]} of {comm.name} sent "
                             f"{len(blob) / 32:g} chunk digests, expected {want}")
    # Task i was digested by rank i % size, as its (i // size)-th digest.
    return [parts[i % comm.size][1][32 * (i // comm.size):32 * (i // comm.size + 1)]
            for i in range(len(tasks))]


def version_hash(hashes: dict[str, str]) -> str:
    """Merkle root (hex SHA-256) over the per-tensor hashes of one weight version.

    Construction (all strings UTF-8):
      leaves:  leaf_i = sha256(name_i + "\\0" + hash_i), in the dict's iteration order (callers
               pass the canonical param_shapes order, so the order is part of the version);
      levels:  the next level pairs neighbours, node = sha256(left + right) over the raw 32-byte
               digests; an odd last node is carried up unchanged, not duplicated;
      root:    the single node left, as 64 lowercase hex characters.
    One tensor gives its leaf as root. An empty dict gives sha256(b"") (no weights at all).
    So the root changes when any name, any hash or the order changes; and given the leaf list,
    a differing tensor can be located in O(log n) node comparisons.

    Raises: ValueError if a name contains "\\0" (it would make leaves ambiguous).
    """
    level: list[bytes] = []
    for name, h in hashes.items():
        if "\0" in name:
            raise ValueError(f"version_hash: tensor name {name!r} contains a NUL character")
        level.append(hashlib.sha256(f"{name}\0{h}".encode()).digest())
    if not level:
        return hashlib.sha256(b"").hexdigest()
    while len(level) > 1:
        nxt = [hashlib.sha256(level[i] + level[i + 1]).digest()
               for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].hex()


def compare_hashes(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Human-readable differences between two per-tensor hash dicts; [] means identical.

    One line per problem, each naming its tensor: a tensor in `expected` but not in `actual`
    ("missing tensor"), in `actual` but not `expected` ("unexpected extra tensor"), present in
    both with different hashes ("tensor X differs"), and, since the order is part of
    `version_hash`, one line if the shared tensors appear in a different order. So an empty
    list implies equal `version_hash` of the two dicts.
    """
    problems: list[str] = []
    for name, h in expected.items():
        if name not in actual:
            problems.append(f"missing tensor {name!r} (expected hash {h[:16]}...)")
        elif actual[name] != h:
            problems.append(f"tensor {name!r} differs: expected hash {h[:16]}..., "
                            f"got {actual[name][:16]}...")
    for name in actual:
        if name not in expected:
            problems.append(f"unexpected extra tensor {name!r} (hash {actual[name][:16]}...)")
    exp_order = [n for n in expected if n in actual]
    act_order = [n for n in actual if n in expected]
    if exp_order != act_order:
        i = next(i for i, (a, b) in enumerate(zip(exp_order, act_order)) if a != b)
        problems.append(f"tensor order differs at position {i}: expected {exp_order[i]!r}, "
                        f"got {act_order[i]!r}")
    return problems

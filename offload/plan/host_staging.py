"""Host memory the runtime's background lanes hold for nvme-homed states: pure arithmetic, shared by `offload plan`
(memory.tier_bytes' cpu "staging") and the runtime's refusal at wrap (offload.zero.placement), so that the two
cannot disagree.

Nvme-homed shards are cut into chunks of Config.chunk_size bytes of fp32 (default: the cpu budget / 64, between
1 MiB and 64 MiB), and every short-lived working copy in the cpu tier takes one staging slot, the largest chunk's
fp32 bytes page-rounded. The lanes run concurrently and wait on one another's buffers, so all of them must fit at
once: the gather lane every param chunk of the largest unit (params on nvme), the optimizer lane one chunk of
each state it steps, the reduce-drain lane one gradient chunk. That is the floor the runtime refuses a cpu budget
below; its read-ahead (the next units' params, the optimizer's next chunks) only fills what the budget has left.
So the staging grows with the largest unit's param bytes (its chunk count) and with the chunk size, not with all
of a unit's states: a 1.05B-parameter embedding stages 63 param chunks and 7 state chunks of 64 MiB, 4.4 GiB,
where four copies of its every state would be 50 GB.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from ..store.sizes import page_bytes

CHUNK_ALIGN = 2048  # elements: chunk boundaries on 4 KiB of bf16 / 8 KiB of fp32
MIN_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 64 << 20


def chunk_numel_for(cpu_budget: int, setting: int | None) -> int:
    """Elements per chunk: the setting (fp32 bytes), else cpu_budget / 64 within [1 MiB, 64 MiB] of fp32."""
    nbytes = setting if setting is not None else min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, cpu_budget // 64))
    return max(CHUNK_ALIGN, nbytes // 4 // CHUNK_ALIGN * CHUNK_ALIGN)


def equal_chunk(shard_numel: int, chunk_numel: int) -> int:
    """Elements per chunk cutting a shard of shard_numel into equal (aligned) chunks of at most chunk_numel."""
    pieces = max(1, -(-shard_numel // chunk_numel))
    size = -(-shard_numel // pieces)
    return -(-size // CHUNK_ALIGN) * CHUNK_ALIGN


def fit_chunk(chunk_numel: int, shard_numels: list[int]) -> int:
    """The chunk length, shortened so that the shard size holding the most elements in all (a repeated block's)
    splits into equal chunks of exactly it: most working copies then fill their staging slot (the largest chunk)
    to the byte, and every other unit's equal chunks are no longer. By elements, not by count: 16 LoRA adapters
    of 2048 elements each outnumber 4 blocks of 850K, and cut to their size every block took 415 chunks."""
    counts = collections.Counter(n for n in shard_numels if n)
    if not counts:
        return chunk_numel
    common = max(counts, key=lambda n: (counts[n] * n, n))
    return min(chunk_numel, equal_chunk(common, chunk_numel))


def chunk_sizes(shard_numel: int, chunk_numel: int) -> list[int]:
    """The chunks (elements each) a shard of shard_numel is cut into: equal ones of equal_chunk, the last shorter."""
    size = equal_chunk(shard_numel, chunk_numel)
    return [min(size, shard_numel - lo) for lo in range(0, shard_numel, size)] or [0]


@dataclass(frozen=True)
class WorkingSet:
    """Bytes of the cpu budget each background lane may hold at once to make progress (host_working_set)."""

    gather: int  # every param chunk of the largest unit (while params page)
    step: int  # one chunk of each state the optimizer steps
    reduce: int  # one gradient chunk a reduce adds into (while gradients page)

    @property
    def total(self) -> int:
        return self.gather + self.step + self.reduce


def staging_slot(unit_chunks: list[list[int]]) -> int:
    """Bytes every short-lived cpu working copy takes (the store's staging slot, store/arena.py): the largest
    chunk of any state, in fp32, page-rounded. `unit_chunks`: every unit's chunk sizes, in elements."""
    return page_bytes(4 * max((n for chunks in unit_chunks for n in chunks), default=0))


# See [Note: the cpu budget's order of claims] in docs/zero-runtime.md
def host_working_set(unit_chunks: list[list[int]], width: int, params_nvme: bool, optimizer_nvme: bool,
                     grads_nvme: bool | None = None, optimizer_states: int = 2) -> WorkingSet:
    """Bytes of the cpu budget that the background lanes may hold at once to make progress, for nvme-homed
    states (memory homes lend their home copy and stage nothing): the gather lane reads every param chunk of
    the largest unit, the optimizer lane one chunk of each state it steps, the reduce-drain lane one gradient chunk.
    Those lanes run concurrently and wait for one another's buffers, so all three must fit together; what
    the prefetch and the resident states use comes on top (the schedule reserves this first). Each of those
    working copies takes one staging slot (staging_slot), whatever its dtype.
    `unit_chunks`: every unit's chunk sizes, in elements; grads_nvme: None when the gradients live with the
    optimizer states (their tier is decided after the fit, so the fit counts them like those); optimizer_states:
    how many states the family stores per chunk (its schema's; AdamW 2, AdamW8bit 4: codes and scales)."""
    grads_nvme = optimizer_nvme if grads_nvme is None else grads_nvme
    slot = staging_slot(unit_chunks)
    gather = max((len(chunks) for chunks in unit_chunks), default=0) * slot if params_nvme else 0
    # the step: the family's states and the fp32 master unless the fp32 param is it (optimizer on nvme); the
    # gradient chunk it reads (gradients on nvme); the param chunk it writes (params on nvme)
    kinds = (optimizer_states + (1 if width != 4 else 0) if optimizer_nvme else 0) + int(grads_nvme) + int(params_nvme)
    reduce = slot if grads_nvme else 0  # the gradient chunk a reduce adds into
    return WorkingSet(gather, kinds * slot, reduce)


def staging_bytes(unit_params: list[int], ranks: int, width: int, params_nvme: bool, optimizer_nvme: bool,
                  grads_nvme: bool, optimizer_states: int, cpu_budget: float | None,
                  chunk_setting: int | None = None) -> int:
    """host_working_set for a model's units (their parameter counts; ZeRO-3 gives each rank 1/ranks of each), cut
    into chunks as the runtime cuts them under a cpu budget of `cpu_budget` bytes a rank (None: a host large enough
    for the largest chunk) or Config.chunk_size (`chunk_setting`, fp32 bytes)."""
    if not (params_nvme or optimizer_nvme or grads_nvme):
        return 0
    shards = [-(-n // ranks) for n in unit_params]
    chunk = chunk_numel_for(MAX_CHUNK_BYTES * 64 if cpu_budget is None else int(cpu_budget), chunk_setting)
    chunk = fit_chunk(chunk, shards)
    unit_chunks = [chunk_sizes(n, chunk) for n in shards]
    return host_working_set(unit_chunks, width, params_nvme, optimizer_nvme, grads_nvme, optimizer_states).total

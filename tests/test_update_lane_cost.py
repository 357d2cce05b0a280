"""What the optimizer lane spends a step on besides its kernel (issue 42 section 1: the lane <= 1.2x the fused kernel
over the same parameters, states resident in the cpu tier). Each test counts or orders what was cut, not a time.

The lane steps the units in the next forward's order, so it starts with the unit the backward reduced last: it
waited for that unit's whole gradient to be drained (written into the gradient chunks, their norms taken) before
its first chunk, about a unit's worth of copying a step (0.04-0.06 s of the bench's 0.28 s at 400M parameters)."""
from __future__ import annotations

import threading
import time

import torch

import offload
from offload.zero.units import unit as unit_module
from offload.zero.units.piece_norms import PieceNorms
from offload.zero.update.optimizer_pipeline import OptimizerPipeline
from zero_common import LinearStack, trained_stack


def _config(**kw) -> offload.Config:
    # chunks of 2048 elements: a Linear(64)'s 4160 elements are 3 chunks
    return offload.Config(params="cpu", optimizer="cpu", cpu_budget="64MiB", device_budget="64MiB",
                          chunk_size="8KiB", speculative_updates=False, **kw)


def test_an_update_reads_its_first_gradient_chunks_while_the_drain_writes_the_last(monkeypatch):
    events: list[tuple] = []
    lock = threading.Lock()
    feed, step = PieceNorms.feed, OptimizerPipeline._step

    def slow_last_chunk(self, c, g):  # the drain's norms of a unit's last chunk take long
        feed(self, c, g)
        if c.hi >= max(p.hi for p in self.pieces):
            time.sleep(0.5)
            with lock:
                events.append(("drained", id(self)))

    def stepped(self, item):
        step(self, item)
        with lock:
            events.append(("stepped", item.update.unit.uid, item.chunk.index))

    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    big = monkeypatch.context()  # every drain on its lane, as a large unit's (a small one's runs in the backward)
    with big as patch, offload.init(_config()) as rt:
        patch.setattr(unit_module, "SMALL_WORK_BYTES", 0)
        model, opt = trained_stack(64, 2, x, steps=2)
        rt.quiesce()
        first = next(u for u in rt.units if u.uid == "blocks.0")  # the block the backward reduces last
        assert len(first.shards.chunks) == 3
        monkeypatch.setattr(PieceNorms, "feed", slow_last_chunk)
        monkeypatch.setattr(OptimizerPipeline, "_step", stepped)
        rt.updates._norms_asked = True  # as after a step that clipped: the drains take the norms (slowed above)
        model(x).square().mean().backward()
        opt.step()
        rt.quiesce()
        monkeypatch.undo()
    mine = [e for e in events if e[0] == "drained" or e[1] == first.uid]
    at = {e: k for k, e in enumerate(mine)}
    drained = [k for e, k in at.items() if e[0] == "drained"]
    # its first chunk was stepped while a drain still wrote a last chunk (before: after every drain was over)
    assert at[("stepped", first.uid, 0)] < max(drained), mine
    assert at[("stepped", first.uid, 2)] > max(drained), mine  # the last chunk waits for the whole drain


def test_the_overlap_keeps_the_update_bitwise_that_of_the_synchronous_runtime():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    out = {}
    for pipeline in (True, False):
        with offload.init(_config(pipeline=pipeline)) as rt:
            torch.manual_seed(0)
            model = LinearStack(64, 3)
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            for _ in range(4):
                model(x).square().mean().backward()
                rt.clip_grad_norm_(0.05)
                opt.step()
                opt.zero_grad()
            out[pipeline] = {k: v.clone() for k, v in model.state_dict().items()}
    for k in out[False]:
        assert torch.equal(out[True][k], out[False][k]), k


def test_the_lane_makes_each_chunks_state_specs_once(monkeypatch):
    """A chunk's specs (its shard keys) were made again by each step of its update that needed one (its leases,
    the param hand-over), and the list of what it leases for every chunk. Now once per chunk stepped."""
    from offload.zero.shards import UnitShards

    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    with offload.init(_config()) as rt:
        model, opt = trained_stack(64, 3, x, steps=2)
        rt.quiesce()
        made = []
        spec = UnitShards.spec

        def on_the_lane(self, kind, c):
            if threading.current_thread().name.startswith("offload-optimizer"):
                made.append(kind)
            return spec(self, kind, c)

        monkeypatch.setattr(UnitShards, "spec", on_the_lane)
        model(x).square().mean().backward()
        opt.step()
        rt.quiesce()
        monkeypatch.undo()
        chunks = sum(len(u.shards.chunks) for u in rt.units if u.shards.shard_numel)
    per_chunk = 1 + len(offload.AdamW.schema.states) + 1  # the gradient, the moments, the fp32 param (its master)
    assert len(made) == per_chunk * chunks, f"{len(made)} specs made for {chunks} chunks"


def test_stepping_a_chunk_at_rest_in_memory_allocates_no_tensor(monkeypatch):
    """Each lease of a chunk homed in memory views its block; the view made a throwaway tensor to learn the dtype's
    size (four a chunk stepped, six with AdamW8bit's states)."""
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    with offload.init(_config()) as rt:
        model, opt = trained_stack(64, 3, x, steps=2)
        model(x).square().mean().backward()
        rt.quiesce()
        made = []
        empty = torch.empty

        def on_the_lane(*args, **kw):
            if threading.current_thread().name.startswith("offload-optimizer"):
                made.append(args)
            return empty(*args, **kw)

        monkeypatch.setattr(torch, "empty", on_the_lane)
        opt.step()
        rt.quiesce()
        monkeypatch.undo()
    assert not made, f"{len(made)} tensors made on the optimizer lane for a step of states at rest in memory"

"""rt.save_checkpoint / rt.load_checkpoint: a resumable run, sharded per rank, nothing pickled.

    ROOT/latest                         the name of the newest complete checkpoint (moved last)
    ROOT/step-120/manifest.json         world size, units and their slots, placement, dtype policy, versions,
                                        optimizer hyper-parameters and per-parameter step counts, LR
                                        schedulers, python/numpy RNG per rank, the user's `extra`, and the
                                        size and sha256 of every file
    ROOT/step-120/rank-00000-of-00002.safetensors   this rank's fp32 master and optimizer states of every
                                        unit (its shard of the flat layout; each state as its family's per-element
                                        fp32 view: AdamW8bit's moments dequantized) and its torch RNG states

A checkpoint taken in the middle of a gradient accumulation also holds the gradient shards summed so far
(gradients accumulated under no_sync are reduced first) and which parameters got one; the user's loop
position travels in `extra`.

Writing: every rank streams its shards chunk by chunk (leases, bounded memory) into ROOT/.tmp-step-120,
each file fsynced with its checksum computed on the way; rank 0 then writes the manifest, renames the
directory into place, and moves `latest`. A process killed at any moment leaves the previous checkpoint
and `latest` as they were (a stale .tmp-* directory is removed by the next save).

Loading (after the model and optimizer exist): every file's size and checksum are verified, and every unit's
slot names and shapes compared with the model, before a single byte is written into the store. A
checkpoint saved with another world size or placement loads: each rank reads its new shard's range from
whichever old rank files hold it.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import torch

from ..checkpoint.files import (CheckpointError, TensorFileWriter, atomic_write_text, check_owned_dir, fsync_dir,
                                make_private_dir, open_private, safe_member, sha256_of)
from ..checkpoint.manifest import FORMAT, LATEST, MANIFEST, VerifiedFiles, rank_file, read_manifest, resolve
from ..store.sizes import format_bytes
from .. import inject
from ..version import __version__
from ..store import LeaseMode, Tier
from ..telemetry import Queue
from .collectives import objects
from .update import optim_states
from ..optim.schema import by_name as schema_by_name
from .shards import StateKind
from .state_store import Use



def _param_key(p) -> str:
    unit = p._offload_unit
    return f"{unit.uid}:{unit.layout.slots[p._offload_slot].fqn}"


def _all_gather(rt, obj, what: str) -> list:
    """Every rank's `obj`: in the runtime's one order, watched and recorded (collectives/objects.py)."""
    return objects.all_gather_object(rt.group, obj, f"checkpoint: {what}")


def _rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON part: python and numpy; tensors: torch CPU and CUDA generator states)."""
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss = random.getstate()
    json_part = {"python": [version, list(state), gauss],
                 "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # this rank's GPU only (the current device: bound at offload.init): the
        # others are other ranks' (touching them would put a context on each)
        tensors["rng/cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return json_part, tensors


def _set_rng_state(json_part: dict, tensors: dict[str, torch.Tensor]) -> None:
    import numpy as np

    version, state, gauss = json_part["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = json_part["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng/torch"])
    if not torch.cuda.is_available():
        return
    device = torch.cuda.current_device()
    state = tensors.get("rng/cuda", tensors.get(f"rng/cuda{device}"))  # (rng/cudaN: every GPU's, older checkpoints)
    if state is not None:
        torch.cuda.set_rng_state(state, device)


def _fork_rng(rank: int) -> None:
    """Reseed python's, numpy's and torch's generators (and this GPU's) from one draw of the restored torch stream
    and `rank`: a rank the checkpoint had no streams for gets streams of its own, the same at every such resume."""
    import numpy as np

    seed = (int(torch.randint(0, 2 ** 62, (1,)).item()) + 1_000_003 * rank) % 2 ** 63
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)  # this rank's GPU only (the others are other ranks')


# ---- save ---------------------------------------------------------------------------------------
RESERVED = (LATEST, MANIFEST)


def _agree(rt, what: str, fn) -> object:
    """Run `fn` (on this rank) and share whether it worked: when any rank fails, every rank raises the same
    CheckpointError, so no rank is left waiting in the next collective."""
    try:
        result, error = fn(), None
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        result, error = None, f"rank {rt.rank}: {what}: {exc}"
    errors = [e for e in _all_gather(rt, error, what) if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    return result


def save_checkpoint(rt, root, extra: dict | None = None, lr_schedulers=(), keep_last: int | None = None,
                    tag: str | None = None, add_files=None) -> Path:
    """Write a checkpoint under `root` (module docstring); collective. `add_files(dir)` (rank 0) writes
    auxiliary files into the checkpoint before it is sealed (config.json, tokenizer: `offload export` copies
    them). Returns its directory."""
    t0 = time.perf_counter()
    root = Path(root)
    tag = tag or f"step-{rt.step_stats.steps}"
    safe_member(root, tag, "save_checkpoint(tag=...)")
    if tag in RESERVED or tag.startswith("."):
        raise CheckpointError(f"save_checkpoint(tag={tag!r}): reserved (names starting with '.', {RESERVED}); "
                              "choose another tag")
    try:
        extra_json = json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"save_checkpoint(extra=...): must be JSON-serializable (no pickles): {exc}") from None
    run_dir = rt.states.run_dir
    if run_dir is not None and (root.resolve() == run_dir.resolve() or run_dir.resolve() in root.resolve().parents):
        raise CheckpointError(f"save_checkpoint({root}): inside the runtime's swap directory {run_dir}, which is "
                              "deleted when the runtime closes; save checkpoints somewhere else")
    rt.flush_grads()  # gradients accumulated under no_sync are reduced into the shards saved below
    rt.quiesce()  # every queued update and reduce is in the shards written below
    tmp, final = root / f".tmp-{tag}", root / tag

    def prepare():
        if rt.rank == 0:
            make_private_dir(root, "checkpoint directory")
            _clean_partial(root)
            tmp.mkdir(mode=0o700)

    _agree(rt, f"preparing {root}", prepare)
    name = rank_file(rt.rank, rt.world_size)
    rng_json, rng_tensors = _rng_state()
    # each rank counts steps for the parameters in its own shard: the manifest takes the union
    steps = [{_param_key(p): int(st["step"]) for p, st in opt.state.items() if "step" in st}
             for opt in rt.live_optimizers()]
    status = {"file": name, "rng": rng_json, "steps": steps,
              "used": {u.uid: list(u.used) for u in rt.units if u.has_grad},
              "moments": [u.uid for u in rt.units if u.shards.moments_registered],
              "schemas": {u.uid: u.shards.schema.name for u in rt.units if u.shards.moments_registered}}
    try:
        check_owned_dir(tmp, "checkpoint directory")
        status.update(_write_rank_file(rt, tmp / name, rng_tensors))
    except OSError as exc:
        status["error"] = (f"rank {rt.rank}: writing {tmp / name} failed: {exc.strerror or exc} (errno {exc.errno}); "
                           f"{_free(root)} free under {root}; free space or choose another directory. The previous "
                           "checkpoint is untouched")
    except Exception as exc:  # noqa: BLE001 - a corrupt swap slot, a refused path: every rank must hear of it
        status["error"] = f"rank {rt.rank}: writing {tmp / name} failed: {exc}"
    statuses = _all_gather(rt, status, "each rank's file written")
    errors = [s["error"] for s in statuses if "error" in s]
    if errors:
        if rt.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError("; ".join(errors))

    def seal():
        if rt.rank != 0:
            return
        try:
            manifest = _manifest(rt, tag, statuses, extra_json, lr_schedulers)
            if add_files is not None:
                add_files(tmp)
            for aux in sorted(p for p in tmp.iterdir() if p.is_file() and p.name not in manifest["files"]):
                with open_private(aux, write=False) as f:
                    os.fsync(f.fileno())  # durable before the directory is renamed into place
                manifest["files"][aux.name] = {"bytes": aux.stat().st_size, "sha256": sha256_of(aux), "aux": True}
            atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
            fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = root / f".old-{tag}"
        if final.exists():  # the same tag saved again: swap the new one in, then drop the old one
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(root)
        atomic_write_text(root / LATEST, tag + "\n")
        shutil.rmtree(old, ignore_errors=True)  # only once `latest` names the new one
        if keep_last:
            _prune(root, keep_last, keep=tag)

    _agree(rt, f"sealing {final}", seal)
    rt.last_checkpoint_seconds = time.perf_counter() - t0
    return final


def _free(root: Path) -> str:
    try:
        return format_bytes(shutil.disk_usage(root).free)
    except OSError:
        return "unknown bytes"


def _clean_partial(root: Path) -> None:
    """Remove what a killed save left: .tmp-* (never sealed), and .old-<tag> once <tag> is complete again
    (a kill between the two renames of a re-save leaves the complete old copy there, which load falls back to)."""
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.tmp-*"):  # a `latest` being replaced when the save was killed
        stale.unlink(missing_ok=True)
    for old in root.glob(".old-*"):
        if (root / old.name[len(".old-"):] / MANIFEST).is_file():
            shutil.rmtree(old, ignore_errors=True)


def _write_rank_file(rt, path: Path, rng_tensors: dict[str, torch.Tensor]) -> dict:
    writer = TensorFileWriter(path, metadata={"format": FORMAT})
    plan = []  # (unit, label, the stored state read as is, or None: the family's view `label`, unpacked)
    for unit in rt.units:
        schema = unit.shards.schema
        items = [("master", unit.shards.master_kind())]
        for view in schema.logical if schema else ():
            items.append((view.name, schema.state(view.name) if view.identity else None))
        if unit.has_grad:  # in the middle of a gradient accumulation: the partial sum goes too
            items.append(("grad", StateKind.GRAD))
        for label, kind in items:
            # on a page: its chunks (8 KiB multiples but the last) can share their swap slots' blocks
            writer.add(f"{unit.uid}/{label}", torch.float32, unit.shards.shard_numel, aligned=True)
            plan.append((unit, label, kind))
    for key, t in rng_tensors.items():
        writer.add(key, t.dtype, t.numel())
    writer.open()
    from_nvme = from_host = 0
    resident = rt.states.resident_keys()  # the runtime is quiet: residency does not change during the save
    try:
        for unit, label, kind in plan:
            if kind is None:  # a quantized state: its fp32 view, one chunk in memory at a time
                for c in unit.shards.chunks:
                    writer.write(optim_states.read_view_chunk(unit, label, c))
                    inject.pause(Queue.CHECKPOINT)
                from_host += unit.shards.shard_numel * 4
                continue
            for c in unit.shards.chunks:  # one chunk in memory at a time
                spec = unit.shards.spec(kind, c)
                slot = rt.states.swap_location(spec) if spec.home is Tier.NVME and spec.key not in resident else None
                if slot is not None:
                    from_nvme += spec.nbytes
                else:
                    from_host += spec.nbytes
                lease = rt.states.lease(spec, Use.HOST, LeaseMode.READ)  # (from a slot: its checksum verified)
                try:
                    values = lease.wait().float()
                    if slot is not None and values.dtype == spec.dtype:  # the slot holds these very bytes
                        writer.clone(values, *slot)
                    else:
                        writer.write(values)
                finally:
                    lease.release()
                inject.pause(Queue.CHECKPOINT)  # a slow disk (tests: a kill lands mid-write)
        for t in rng_tensors.values():
            writer.write(t)
        size, digest = writer.close()
    except BaseException:
        writer.abort()
        raise
    # Which path the bytes took: every chunk is read into a one-chunk host buffer (from a swap slot by the aio
    # engine, its checksum verified) and hashed; a swap slot's bytes then share its blocks with the file where
    # the filesystem clones ranges, and are written otherwise, as resident states are.
    how = ("swap slots reflinked into the file (FICLONERANGE)" if writer.cloned_bytes else
           f"written with write(2) (no reflink: {writer.no_reflink or 'no swap slot to share'})")
    transfer = {"path": f"engine read of each chunk -> sha256 -> {how}", "from_nvme_bytes": from_nvme,
                "from_host_bytes": from_host, "reflinked_bytes": writer.cloned_bytes,
                "written_bytes": writer.written_bytes}
    return {"bytes": size, "sha256": digest, "transfer": transfer}


def _manifest(rt, tag: str, statuses: list[dict], extra: dict, lr_schedulers) -> dict:
    schedulers = []
    for s in lr_schedulers:
        sd = {k: v for k, v in s.state_dict().items() if k != "lr_lambdas"}  # lambdas are code, rebuilt by the user
        try:
            schedulers.append(json.loads(json.dumps(sd)))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"save_checkpoint: the state of {type(s).__name__} is not JSON ({exc})") from None
    optimizers = []
    for k, opt in enumerate(rt.live_optimizers()):
        groups = []
        for g in opt.param_groups:
            hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                     if k != "params" and isinstance(v, (int, float, str, bool, tuple, list, type(None)))}
            groups.append({**hyper, "params": [_param_key(p) for p in g["params"]]})
        steps = {}
        for status in statuses:
            steps.update(status["steps"][k])
        optimizers.append({"param_groups": groups, "steps": steps})
    return {
        "format": FORMAT,
        "tag": tag,
        "optimizer_steps": rt.step_stats.steps,
        "versions": {"offload": __version__, "torch": torch.__version__},
        "world_size": rt.world_size,
        "compute_dtype": rt.config.compute_dtype,
        "placement": {"params": rt.params_tier, "optimizer": rt.optimizer_tier, "grads": rt.grads_tier},
        "units": [{"uid": u.uid, "numel": u.layout.numel, "padded_numel": u.layout.padded_numel,
                   "moments": any(u.uid in st["moments"] for st in statuses), "grad": u.has_grad,
                   # the optimizer family whose states were saved (checkpoints before it: AdamW's)
                   "optimizer_states": next((st["schemas"][u.uid] for st in statuses if u.uid in st["schemas"]),
                                            None),
                   # which parameters got a gradient so far (any rank), for an accumulation in progress
                   "used": [any(s["used"].get(u.uid, [False] * len(u.layout.slots))[i] for s in statuses)
                            for i in range(len(u.layout.slots))],
                   "slots": [{"name": s.fqn, "shape": list(s.shape), "offset": s.offset} for s in u.layout.slots]}
                  for u in rt.units],
        "optimizers": optimizers,
        "lr_schedulers": schedulers,
        "rng": [s["rng"] for s in statuses],
        "extra": extra,
        "files": {s["file"]: {"bytes": s["bytes"], "sha256": s["sha256"]} for s in statuses},
        "moments_on": {s["file"]: s["moments"] for s in statuses},  # a rank whose shard is all frozen has none
        "transfer": {s["file"]: s["transfer"] for s in statuses},  # which path the bytes took, per rank
    }


def _prune(root: Path, keep_last: int, keep: str) -> None:
    """All but the newest `keep_last` complete checkpoints go, newest by their optimizer step (a directory's time
    moves while a removal runs: a half-removed one looked newest and a good one went instead). Each is renamed out
    of sight first, durably: a kill in the removal leaves a .tmp-* the next save clears, never a checkpoint
    missing files under its own name."""
    def age(p: Path) -> tuple:
        try:
            return json.loads((p / MANIFEST).read_text())["optimizer_steps"], p.stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError):
            return -1, p.stat().st_mtime

    done = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                   and (p / MANIFEST).is_file()), key=age)
    for old in done[:-keep_last]:
        if old.name != keep:
            gone = root / f".tmp-pruned-{old.name}"
            shutil.rmtree(gone, ignore_errors=True)
            os.replace(old, gone)
            fsync_dir(root)
            shutil.rmtree(gone)


# ---- load ---------------------------------------------------------------------------------------
def _check_units(rt, manifest: dict, path: Path) -> dict:
    saved = {u["uid"]: u for u in manifest["units"]}
    errors = []
    for unit in rt.units:
        entry = saved.get(unit.uid)
        if entry is None:
            errors.append(f"unit {unit.uid!r} is not in the checkpoint")
            continue
        mine = [(s.fqn, list(s.shape)) for s in unit.layout.slots]
        theirs = [(s["name"], s["shape"]) for s in entry["slots"]]
        if mine != theirs:
            diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
            errors.append(f"unit {unit.uid or '<root>'!r}: " + (
                f"model {diff[0][0]} {diff[0][1]} but checkpoint {diff[1][0]} {diff[1][1]}" if diff else
                f"model has {len(mine)} parameters, checkpoint {len(theirs)}"))
    extra = sorted(set(saved) - {u.uid for u in rt.units})
    if extra:
        errors.append(f"units {extra} are in the checkpoint but not in the model")
    if errors:
        raise CheckpointError(f"{path}: the checkpoint does not fit this model: " + "; ".join(errors[:6]) +
                              ". Build the same model (same config) before load_checkpoint")
    _check_families(rt, saved, path)
    return saved


def _check_families(rt, saved: dict, path: Path) -> None:
    """The optimizer family that saved each unit's states is the one stepping it now (its states mean nothing to
    another: AdamW8bit's codes are not AdamW's moments, Lion has one state)."""
    family = {}
    for opt in rt.live_optimizers():
        for unit, _ in opt._unit_plan():
            family.setdefault(id(unit), opt.schema)
    for unit in rt.units:
        entry = saved[unit.uid]
        now = family.get(id(unit)) or unit.shards.schema
        then = entry.get("optimizer_states") or "adamw"
        if entry["moments"] and now is not None and now.name != then:
            raise CheckpointError(
                f"{path}: unit {unit.uid or '<root>'!r} has optimizer states of family {then!r} in the checkpoint, "
                f"and this run steps it with {now.name!r}; load it with the optimizer class that saved it, or "
                "load the weights only (offload export / the model's state dict) and start the optimizer fresh")


def _old_ranks_needed(rt, manifest: dict) -> list[int]:
    """The saving ranks whose files hold part of this rank's new shards (the only files it reads)."""
    old_world = manifest["world_size"]
    saved = {u["uid"]: u for u in manifest["units"]}
    need = {min(rt.rank, old_world - 1)}  # this rank's RNG states
    for unit in rt.units:
        old_shard = saved[unit.uid]["padded_numel"] // old_world
        lo, hi = unit.layout.shard_bounds(rt.rank)
        for r in range(old_world):
            if max(lo, r * old_shard) < min(hi, (r + 1) * old_shard, unit.layout.numel):
                need.add(r)
    return sorted(need)


# See [Note: every rank meets first] in docs/zero-runtime.md
def load_checkpoint(rt, root, lr_schedulers=()) -> dict:
    """Load the checkpoint at `root` (module docstring) into the open runtime; collective. Returns `extra`.
    Every check (files, units, optimizers, schedulers, tensors present) runs before the first write, on every
    rank, and the ranks' verdicts are agreed in one collective before any rank writes: a check failing on one rank
    only (its node's copy of the checkpoint unreadable, its file corrupt) makes every rank raise at once, naming
    that rank and its reason, instead of leaving the others in their next collective until collective_timeout."""
    t0 = time.perf_counter()
    opened: list = []  # the verified files, closed here when a rank's check failed

    def check():
        path = resolve(root)
        manifest = read_manifest(path)
        old_world = manifest["world_size"]
        names = [rank_file(r, old_world) for r in range(old_world)]
        missing = [n for n in names if n not in manifest["files"]]
        if missing:
            raise CheckpointError(f"{path / MANIFEST}: lists no {missing}; the checkpoint is incomplete")
        saved = _check_units(rt, manifest, path)
        needed = _old_ranks_needed(rt, manifest)
        # each rank hashes only what it reads, and reads it through the descriptor it hashed
        files = VerifiedFiles(path, manifest, [names[r] for r in needed])
        opened.append(files)
        handles, keys = _check_loadable(rt, path, manifest, saved, needed, files, lr_schedulers)
        return path, manifest, saved, needed, files, handles, keys

    if not rt.group.distributed:
        loaded = check()
    else:
        try:
            loaded, error = check(), None
        except Exception as exc:  # noqa: BLE001 - every rank hears of it below
            loaded, error = None, f"rank {rt.rank}: {exc}"
        errors = [e for e in _all_gather(rt, error, "each rank's files checked") if e]
        if errors:
            for files in opened:
                files.close()
            raise CheckpointError(f"loading {root} failed on {len(errors)} of {rt.world_size} ranks, so on every "
                                  f"rank (nothing was loaded): " + "; ".join(errors))
    path, manifest, saved, needed, files, handles, keys = loaded
    with files:
        return _load_verified(rt, path, manifest, saved, needed, handles, keys, lr_schedulers, t0)


def _check_loadable(rt, path: Path, manifest: dict, saved: dict, needed: list, files, lr_schedulers):
    """The checks against this run (optimizers, groups, schedulers) and of the files' tensors, before any write:
    a load refused half-way through left the model part loaded (and a bad size read past a tensor's end as
    zeros). Returns the open safetensors handles and their keys."""
    from safetensors import safe_open

    old_world = manifest["world_size"]
    names = [rank_file(r, old_world) for r in range(old_world)]
    optimizers = rt.live_optimizers()
    if len(manifest["optimizers"]) != len(optimizers):
        raise CheckpointError(f"{path}: saved with {len(manifest['optimizers'])} optimizer(s), this run has "
                              f"{len(optimizers)}; create the same optimizers before load_checkpoint")
    for opt, saved_opt in zip(optimizers, manifest["optimizers"]):
        if len(saved_opt["param_groups"]) != len(opt.param_groups):
            raise CheckpointError(f"{path}: an optimizer has {len(opt.param_groups)} param groups, the checkpoint "
                                  f"{len(saved_opt['param_groups'])}; build the same param groups")
    if len(lr_schedulers) > len(manifest["lr_schedulers"]):
        raise CheckpointError(f"{path}: {len(lr_schedulers)} LR scheduler(s) given, the checkpoint saved "
                              f"{len(manifest['lr_schedulers'])}")
    handles = {r: safe_open(files.reader_path(names[r]), framework="pt") for r in needed}
    keys = {r: set(h.keys()) for r, h in handles.items()}
    absent = [f"{names[r]} lacks {unit.uid}/master" for r in needed for unit in rt.units
              if f"{unit.uid}/master" not in keys[r]]
    if absent:
        raise CheckpointError(f"{path}: {'; '.join(absent[:4])}; the checkpoint is corrupt")
    _check_shards(rt, path, saved, handles, keys, old_world)
    return handles, keys


def _load_verified(rt, path: Path, manifest: dict, saved: dict, needed: list, handles: dict, keys: dict,
                   lr_schedulers, t0) -> dict:
    old_world = manifest["world_size"]
    optimizers = rt.live_optimizers()
    rt.forget_failed_updates()  # every state is replaced below: a run an update failed in goes on from here
    rt.backward_updates.check_quiet("rt.load_checkpoint")  # a speculated update would shadow what is loaded
    rt.quiesce()  # nothing may be updating the shards written below
    try:
        for unit in rt.units:
            _load_unit(rt, unit, saved[unit.uid], handles, keys, old_world)
        own = handles[min(rt.rank, old_world - 1)]
        rng_tensors = {k: own.get_tensor(k) for k in keys[min(rt.rank, old_world - 1)] if k.startswith("rng/")}
    finally:
        del handles
    for opt, saved_opt in zip(optimizers, manifest["optimizers"]):
        for group, sg in zip(opt.param_groups, saved_opt["param_groups"]):
            for k, v in sg.items():
                if k != "params" and k in group:
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v
        for g in opt.param_groups:
            for p in g["params"]:
                step = saved_opt["steps"].get(_param_key(p))
                if step is None:
                    opt.state.pop(p, None)
                else:
                    opt.state[p]["step"] = step
    for sched, sd in zip(lr_schedulers, manifest["lr_schedulers"]):
        sched.load_state_dict({**sched.state_dict(), **sd})
    _set_rng_state(manifest["rng"][min(rt.rank, old_world - 1)], rng_tensors)
    if rt.rank >= old_world:  # no saved streams of its own: its own, drawn from the last rank's and its rank
        _fork_rng(rt.rank)     # (they were that rank's copy: the same dropout masks, the same random data)
    rt.step_stats.steps = manifest["optimizer_steps"]
    objects.barrier(rt.group, "checkpoint: every rank loaded")
    rt.last_checkpoint_seconds = time.perf_counter() - t0
    return manifest["extra"]


def _check_shards(rt, path: Path, saved: dict, handles: dict, keys: dict, old_world: int) -> None:
    """The manifest's sizes and families against the model and the files, before anything is written."""
    for unit in rt.units:
        entry, label = saved[unit.uid], unit.uid or "<root>"
        numel, padded = entry.get("numel"), entry.get("padded_numel")
        if numel != unit.layout.numel or not isinstance(padded, int) or padded < numel or padded % old_world:
            raise CheckpointError(f"{path}: unit {label!r}: the manifest says {numel} elements padded to {padded} "
                                  f"over {old_world} rank(s), the model has {unit.layout.numel}; the manifest is "
                                  "corrupt or of another model")
        try:
            schema = schema_by_name(entry.get("optimizer_states") or "adamw", "checkpoint optimizer_states")
        except ValueError as exc:
            raise CheckpointError(f"{path}: unit {label!r}: {exc}") from None
        labels = ["master"] + ([v.name for v in schema.logical] if entry["moments"] else []) + \
            (["grad"] if entry.get("grad") else [])
        for r, handle in handles.items():
            for name in (f"{unit.uid}/{x}" for x in labels):
                if name in keys[r] and handle.get_slice(name).get_shape() != [padded // old_world]:
                    raise CheckpointError(f"{path}: {name} of rank {r} holds {handle.get_slice(name).get_shape()} "
                                          f"elements, the manifest's shard is {padded // old_world}; the checkpoint "
                                          "is corrupt")


def _load_unit(rt, unit, entry: dict, handles: dict, keys: dict, old_world: int) -> None:
    """This rank's new shard of each of the unit's states, assembled from the old ranks' ranges."""
    old_shard = entry["padded_numel"] // old_world
    lo, hi = unit.layout.shard_bounds(rt.rank)
    saved_schema = schema_by_name(entry.get("optimizer_states") or "adamw", "checkpoint optimizer_states")
    views = [v.name for v in saved_schema.logical] if entry["moments"] else []
    labels = ["master"] + views + (["grad"] if entry.get("grad") else [])
    for label in labels:
        buf = torch.zeros(unit.shards.shard_numel, dtype=torch.float32)
        for r, h in handles.items():  # the old ranks whose shards overlap this rank's new one
            a, b = max(lo, r * old_shard), min(hi, (r + 1) * old_shard, unit.layout.numel)
            name = f"{unit.uid}/{label}"
            if a < b and name in keys[r]:  # a rank whose shard is all frozen saved no moments: zeros
                buf[a - lo:b - lo] = handles[r].get_slice(name)[a - r * old_shard:b - r * old_shard]
        if label == "master":
            unit.write_shard(StateKind.PARAM, buf)  # cast to the compute dtype, as the kernel writes it
            if not unit.shards.master_is_param:
                unit.write_shard(StateKind.MASTER, buf)
        elif label == "grad":
            unit.register_grads()
            unit.write_shard(StateKind.GRAD, buf)
        else:
            optim_states.register(unit, saved_schema)
            optim_states.write_view(unit, label, buf)
    if not entry["moments"] and unit.shards.moments_registered:  # never stepped when saved: fresh states
        optim_states.reset(unit)
    # the accumulation state: a saved partial gradient is added to by the next backward
    unit.on_gradient_loaded(bool(entry.get("grad")))
    unit.on_used_flags(entry.get("used", [False] * len(unit.layout.slots)))
    unit.on_shard_written()  # a gathered (persistent) unit re-gathers before its next use

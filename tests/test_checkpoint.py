"""rt.save_checkpoint / rt.load_checkpoint / offload export: exact resume, resharding, faults, safety.

The training runs are tests/checkpoint_worker.py's, several in turn per launch (each from its seed and a fresh
runtime): the one-rank runs in one process, the resharding chain (2 -> 3 -> 8 -> 1 -> 2 ranks) in one launch per
world size, behind module-scoped fixtures. Runs that must survive a kill are processes of their own, killed
with SIGKILL after their first save, while the next checkpoint is being written or while a step runs (each
slowed from then on by offload.inject).
"""
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import offload
from offload.checkpoint import CheckpointError
from offload.checkpoint.export import export_checkpoint
from offload.checkpoint.manifest import rank_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rank_launch  # noqa: E402
import rank_sequences  # noqa: E402
from zero_common import SEQ, VOCAB, TinyTransformer, small_config  # noqa: E402

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "checkpoint_worker.py"


def _launch(tmp: Path, label: str, runs: list[dict], world: int = 1, env: dict | None = None) -> dict:
    """`runs` (worker specs, each with a "name") in turn in one process, or in one launch of `world` ranks
    (tests/rank_launch.py): {name: result}. Each run's collectives are compared across the ranks (rank_sequences)."""
    from safetensors.torch import load_file

    (tmp / "nvme").mkdir(exist_ok=True)
    specs = [{"nvme": str(tmp / "nvme"), **{k: v for k, v in run.items() if k != "name"},
              "out": str(tmp / f"{run['name']}.json")} for run in runs]
    (tmp / f"{label}.spec.json").write_text(json.dumps(specs))
    args, env = [str(WORKER), str(tmp / f"{label}.spec.json")], dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = (subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600) if world == 1
            else rank_launch.launch(args, world, env=env, timeout=600))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for run, spec in zip(runs, specs):
        if world > 1:
            rank_sequences.assert_same_sequences(spec["out"] + ".collectives", world)
        if spec.get("kind") == "streams":  # what each rank drew after the save or load
            results[run["name"]] = [json.loads(Path(f"{spec['out']}.draws-{r}.json").read_text())
                                    for r in range(world)]
        else:
            results[run["name"]] = json.loads(Path(spec["out"]).read_text())
            results[run["name"]]["params"] = load_file(spec["out"] + ".safetensors")
    return results


def _worker(tmp: Path, name: str, world: int = 1, env: dict | None = None, **spec) -> dict:
    """One run in a process (or launch) of its own."""
    return _launch(tmp, name, [dict(spec, name=name)], world, env)[name]


def _checkpoint_collectives(tmp: Path, name: str, world: int) -> list:
    """What run `name`'s ranks issued for the checkpoint (the same on every rank: _launch compared them), in order."""
    seq = rank_sequences.load(str(tmp / f"{name}.json.collectives"), world)[0]
    return [(tuple(e), w) for e, w in zip(seq["entries"], seq["whats"]) if w.startswith("checkpoint: ")]


def _same(a: dict, b: dict, steps) -> None:
    assert [a["losses"][str(s)] for s in steps] == [b["losses"][str(s)] for s in steps]  # bit for bit
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def _flats(ckpt: Path) -> dict:
    """Every (unit, state) of a checkpoint as one unpadded fp32 vector, whatever its world size."""
    from safetensors import safe_open

    path = ckpt / (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else ckpt
    m = json.loads((path / "manifest.json").read_text())
    world, out = m["world_size"], {}
    files = [safe_open(str(path / rank_file(r, world)), framework="pt") for r in range(world)]
    for u in m["units"]:
        for label in ["master"] + (["exp_avg", "exp_avg_sq"] if u["moments"] else []):
            out[(u["uid"], label)] = torch.cat([f.get_tensor(f"{u['uid']}/{label}") for f in files])[:u["numel"]]
    return out


# ---- the runs: one process for the one-rank ones, one launch per world size for the resharding chain ----------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[Path, dict]:
    """The one-rank runs that start from nothing, in one process: uninterrupted ones (never saved: what the
    resumed runs must equal), runs that save, and runs resumed from those saves. Its directory and {name: result}."""
    tmp = tmp_path_factory.mktemp("one_rank")
    unused = str(tmp / "unused")
    runs = [dict(name="full-fp32", steps=8, ckpt=unused), dict(name="full-bf16", steps=8, ckpt=unused,
                                                                compute_dtype="bf16")]
    for dtype in ("fp32", "bf16"):
        ckpt = str(tmp / f"ckpt-{dtype}")
        runs += [dict(name=f"first-{dtype}", steps=5, save_at=[3, 5], keep_last=1, ckpt=ckpt, compute_dtype=dtype),
                 dict(name=f"resumed-{dtype}", steps=8, resume=True, ckpt=ckpt, compute_dtype=dtype)]
    accum = str(tmp / "ckpt-accum")  # saved after the first of two micro-batches of step 2
    runs += [dict(name="full-accum", steps=5, accum=2, ckpt=unused),
             dict(name="first-accum", steps=3, accum=2, save_mid_at=2, ckpt=accum),
             dict(name="resumed-accum", steps=5, accum=2, resume=True, ckpt=accum),
             # states paging through a 160 KiB cpu budget (their swap slots on this machine's filesystem)
             dict(name="first-paged", steps=2, save_at=[2], ckpt=str(tmp / "ckpt-paged"), cpu_budget="160KiB")]
    return tmp, _launch(tmp, "one_rank", runs)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    """The resharding chain's directory: each world size's launch below saves its checkpoints there."""
    return tmp_path_factory.mktemp("chain")


@pytest.fixture(scope="module")
def world2(chain) -> dict:
    """Two ranks, one launch: 7 uninterrupted steps (never saved); a run saved after step 4 (ckpt-2; no later run
    writes into it) and the run resumed from it; AdamW8bit saved after step 3 (ckpt-8bit-2); the frozen-front
    model saved after step 3 (ckpt-frozen-2) going on to step 5, and resumed from that save; and the random
    streams' save (ckpt-streams-2)."""
    ckpt, frozen = str(chain / "ckpt-2"), str(chain / "ckpt-frozen-2")
    return _launch(chain, "world2", [
        dict(name="full", steps=7, ckpt=str(chain / "unused")),
        dict(name="first", steps=4, save_at=[4], ckpt=ckpt),
        dict(name="resumed", steps=7, resume=True, ckpt=ckpt),
        dict(name="first-8bit", steps=3, save_at=[3], ckpt=str(chain / "ckpt-8bit-2"), family="adamw8bit"),
        dict(name="frozen-full", steps=5, save_at=[3], model="frozen_front", ckpt=frozen),
        dict(name="frozen-resumed", steps=5, resume=True, model="frozen_front", ckpt=frozen),
        dict(name="streams-2", kind="streams", ckpt=str(chain / "ckpt-streams-2"))], world=2)


@pytest.fixture(scope="module")
def world3(chain, world2) -> dict:
    """Three ranks, one launch: ckpt-2 loaded (and its first step run) and saved again as ckpt-3; ckpt-8bit-2
    loaded and saved again as ckpt-8bit-3; ckpt-streams-2 loaded twice, each time after seeding anew."""
    return _launch(chain, "world3", [
        dict(name="to3", steps=5, resume=True, ckpt=str(chain / "ckpt-2"), save_loaded_to=str(chain / "ckpt-3")),
        dict(name="to3-8bit", steps=3, resume=True, ckpt=str(chain / "ckpt-8bit-2"),
             save_loaded_to=str(chain / "ckpt-8bit-3"), family="adamw8bit"),
        *[dict(name=f"streams-3-{i}", kind="streams", resume=True, ckpt=str(chain / "ckpt-streams-2"))
          for i in (1, 2)]], world=3)


@pytest.fixture(scope="module")
def world8(chain, world3) -> dict:
    """Eight ranks (cpu tiers): ckpt-3 loaded and saved again as ckpt-8."""
    return _launch(chain, "world8", [dict(name="to8", steps=4, resume=True, ckpt=str(chain / "ckpt-3"),
                                          save_loaded_to=str(chain / "ckpt-8"), params="cpu", optimizer="cpu")],
                   world=8)


@pytest.fixture(scope="module")
def world1(chain, world2, world8) -> dict:
    """One rank, one process: ckpt-2 loaded (cpu tiers) and saved again as ckpt-1; ckpt-8 loaded and saved again
    as ckpt-8-1; ckpt-frozen-2 loaded and saved again as ckpt-frozen-1."""
    return _launch(chain, "world1", [
        dict(name="to1", steps=4, resume=True, ckpt=str(chain / "ckpt-2"), save_loaded_to=str(chain / "ckpt-1"),
             params="cpu", optimizer="cpu"),
        dict(name="8-to1", steps=4, resume=True, ckpt=str(chain / "ckpt-8"), save_loaded_to=str(chain / "ckpt-8-1")),
        dict(name="frozen-to1", steps=3, resume=True, model="frozen_front", ckpt=str(chain / "ckpt-frozen-2"),
             save_loaded_to=str(chain / "ckpt-frozen-1"))])


@pytest.fixture(scope="module")
def world2_again(chain, world1) -> dict:
    """Two ranks (nvme) again: ckpt-1 loaded and saved again as ckpt-1-2."""
    return _launch(chain, "world2_again", [dict(name="to2", steps=4, resume=True, ckpt=str(chain / "ckpt-1"),
                                                save_loaded_to=str(chain / "ckpt-1-2"))], world=2)


# ---- exact resume ------------------------------------------------------------------------------
@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_resume_is_exact_one_rank(tmp_path, compute_dtype, one_rank):
    """Saved after steps 3 and 5 (keep_last=1), resumed: steps 5-7 as the uninterrupted run's, bit for bit; step-3
    pruned, `latest` names step-5, private modes; the manifest says which path the bytes took; offload export
    gives the parameters at the save."""
    tmp, runs = one_rank
    full, first, resumed = (runs[f"{what}-{compute_dtype}"] for what in ("full", "first", "resumed"))
    ckpt = tmp / f"ckpt-{compute_dtype}"
    assert sorted(resumed["losses"]) == ["5", "6", "7"]
    _same(full, resumed, range(5, 8))
    # keep_last=1 pruned step-3; latest names step-5; private modes
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-5"]
    assert (ckpt / "latest").read_text().strip() == "step-5"
    assert stat.S_IMODE(os.stat(ckpt).st_mode) == 0o700 and stat.S_IMODE(os.stat(ckpt / "step-5").st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in (ckpt / "step-5").iterdir())
    transfer = json.loads((ckpt / "step-5" / "manifest.json").read_text())["transfer"][rank_file(0, 1)]
    # the manifest says which path the bytes took (here every nvme-homed state was resident in the cpu budget)
    assert transfer["path"].startswith("engine read") and transfer["from_nvme_bytes"] + transfer["from_host_bytes"] > 0
    # offload export: the consolidated weights are the run's parameters at the save
    out = export_checkpoint(ckpt, tmp_path / "exported")
    from safetensors.torch import load_file

    exported = load_file(out / "model.safetensors")
    for name, value in exported.items():
        assert torch.equal(value, first["params"][name]), name


@pytest.fixture
def xfs_dir(tmp_path):
    """A directory on a fresh XFS filesystem with reflinks (a loop-mounted image), or a skip where this machine
    cannot make one (no mkfs.xfs: apt-get install xfsprogs; not allowed to mount a loop device)."""
    import shutil

    if shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs is not installed (apt-get install xfsprogs)")
    image, mnt = tmp_path / "xfs.img", tmp_path / "xfs"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(400 << 20)  # (XFS's smallest is 300 MiB)
    made = subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"mkfs.xfs failed: {made.stderr.strip()[-200:]}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a loop device here: {mounted.stderr.strip()[-200:]}")
    try:
        os.chmod(mnt, 0o700)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # lazy: a file still mapped (a failed
        #                                                                   test's tensors) does not keep it


def _transfer(ckpt: Path, tag: str) -> dict:
    return json.loads((ckpt / tag / "manifest.json").read_text())["transfer"][rank_file(0, 1)]


def test_swap_slots_are_reflinked_into_the_checkpoint_where_the_filesystem_shares_blocks(xfs_dir):
    """States paging through a 160 KiB cpu budget, swap files and checkpoint on XFS: every chunk read from a
    swap slot (checksum verified, hashed) shares the slot's blocks with the rank file instead of being
    written, the manifest says so, and the run resumes from it bit for bit."""
    ckpt = xfs_dir / "ckpt"
    runs = _launch(xfs_dir, "xfs", [dict(name="full", steps=6, ckpt=str(xfs_dir / "unused"), cpu_budget="160KiB"),
                                    dict(name="first", steps=4, save_at=[4], ckpt=str(ckpt), cpu_budget="160KiB"),
                                    dict(name="resumed", steps=6, resume=True, ckpt=str(ckpt), cpu_budget="160KiB")])
    t = _transfer(ckpt, "step-4")
    assert t["from_nvme_bytes"] > 0 and t["reflinked_bytes"] == t["from_nvme_bytes"], t
    # written: the resident states and the RNG states only
    assert "reflinked" in t["path"] and t["written_bytes"] == t["from_host_bytes"] + torch.get_rng_state().numel(), t
    _same(runs["full"], runs["resumed"], range(4, 6))


def test_without_reflinks_the_slots_bytes_are_written_and_the_manifest_says_why(one_rank):
    """The same on the test machine's own filesystem: where it cannot share blocks (ext4) the bytes read from
    the swap slots are written, and the manifest gives the filesystem's answer."""
    tmp, _ = one_rank
    t = _transfer(tmp / "ckpt-paged", "step-2")
    assert t["from_nvme_bytes"] > 0
    if t["reflinked_bytes"] == 0:
        assert "no reflink: E" in t["path"], t  # e.g. "EOPNOTSUPP: Operation not supported"
        assert t["written_bytes"] >= t["from_nvme_bytes"] + t["from_host_bytes"], t
    else:  # a filesystem that clones ranges (XFS, btrfs)
        assert t["reflinked_bytes"] == t["from_nvme_bytes"], t


def test_resume_is_exact_two_ranks_and_reshards(chain, world2, world1, world2_again):
    """Two ranks saved after step 4 and resumed: steps 4-6 as the uninterrupted run's, bit for bit; the
    checkpoint's own collectives in the runtime's order and recorded; 2 ranks (nvme) -> 1 rank (cpu) -> 2 ranks
    (nvme): every master and moment element lands where it was."""
    _same(world2["full"], world2["resumed"], range(4, 7))
    # the checkpoint's own collectives are in the runtime's order and recorded (collectives/objects.py)
    gather = ("main", "all_gather_object", 0, "uint8")
    saved = _checkpoint_collectives(chain, "first", 2)
    assert (gather, "checkpoint: each rank's file written") in saved and all(e == gather for e, _ in saved), saved
    loaded = _checkpoint_collectives(chain, "resumed", 2)
    assert loaded == [(gather, "checkpoint: each rank's files checked"),
                      (("main", "all_reduce", 1, "float32"), "checkpoint: every rank loaded")], loaded
    ckpt, one, two = chain / "ckpt-2", chain / "ckpt-1", chain / "ckpt-1-2"
    original, via_one, back = _flats(ckpt), _flats(one), _flats(two)
    assert json.loads((one / "step-4" / "manifest.json").read_text())["world_size"] == 1
    assert json.loads((two / "step-4" / "manifest.json").read_text())["world_size"] == 2
    assert original.keys() == via_one.keys() == back.keys()
    for k in original:
        assert torch.equal(original[k], via_one[k]) and torch.equal(original[k], back[k]), k


def test_reshards_through_uneven_world_sizes(chain, world2, world3, world8, world1):
    """2 ranks (nvme) -> 3 (nvme: every shard boundary moves) -> 8 (cpu) -> 1: every master and moment element
    lands where it was, and rank 0's first loss after the load at 3 ranks is the 2-rank run's bit for bit (the same
    parameters, and rank 0's RNG restored: the same batch)."""
    three, eight, one = chain / "ckpt-3", chain / "ckpt-8", chain / "ckpt-8-1"
    for path, world in ((three, 3), (eight, 8), (one, 1)):
        assert json.loads((path / "step-4" / "manifest.json").read_text())["world_size"] == world
    original, flats = _flats(chain / "ckpt-2"), [_flats(three), _flats(eight), _flats(one)]
    assert all(f.keys() == original.keys() for f in flats)
    for k in original:
        assert all(torch.equal(original[k], f[k]) for f in flats), k
    # (the uninterrupted run: the saved one stopped at the save)
    assert world3["to3"]["losses"]["4"] == world2["full"]["losses"]["4"]


def test_8bit_moments_reshard_without_loss(chain, world2, world3):
    """AdamW8bit saved at 2 ranks, loaded at 3 (every shard boundary moves) and saved again: each moment element
    is what it was, bit for bit. Shard boundaries fall on the moments' quantization blocks at any world size, so
    each block is re-quantized from its own dequantized values, which gives back its codes and scale; with
    boundaries inside blocks (ALIGN 16) a block mixed two old ones and the moments moved by up to a code step."""
    from offload.ops.adam8bit import BLOCK
    from offload.zero.placement import CHUNK_ALIGN
    from offload.zero.units.layout import ALIGN

    assert ALIGN % BLOCK == 0 and CHUNK_ALIGN % BLOCK == 0  # (what the bit-for-bit claim rests on)
    original, resharded = _flats(chain / "ckpt-8bit-2"), _flats(chain / "ckpt-8bit-3")
    assert json.loads((chain / "ckpt-8bit-3" / "step-3" / "manifest.json").read_text())["world_size"] == 3
    assert original.keys() == resharded.keys()
    assert any(original[k].abs().sum() > 0 for k in original if k[1] == "exp_avg")  # moments were trained
    for k in original:
        assert torch.equal(original[k], resharded[k]), k


def test_ranks_the_checkpoint_had_no_streams_for_get_streams_of_their_own(world2, world3):
    """Saved at 2 ranks, loaded at 3: rank 2 had no random streams saved. It took rank 1's, so both drew the same
    dropout masks and the same random data; now its own, the same at every such resume (two in one launch, each
    after seeding every generator anew). Ranks 0 and 1 go on with their saved streams."""
    before, first, second = world2["streams-2"], world3["streams-3-1"], world3["streams-3-2"]
    assert first[0] == before[0] and first[1] == before[1]  # their own saved streams, going on
    assert first[2] != first[1] and first == second  # its own, the same at each resume


def test_a_rank_without_moments_for_a_unit_resumes_and_reshards(chain, world2, world1):
    """At 2 ranks rank 0's shard of each block is all frozen (no moments there), rank 1's is not: the
    checkpoint says which rank has what; resuming is exact, and loading at 1 rank takes rank 1's moments.
    (The resume is compared with the saving run itself, which went on: that a save leaves a 2-rank run as it was
    is test_resume_is_exact_two_ranks_and_reshards'.)"""
    ckpt = chain / "ckpt-frozen-2"
    manifest = json.loads((ckpt / "step-3" / "manifest.json").read_text())
    on = manifest["moments_on"]
    assert not any(u.startswith("blocks.") for u in on[rank_file(0, 2)])
    assert {"blocks.0", "blocks.1"} <= set(on[rank_file(1, 2)])
    _same(world2["frozen-full"], world2["frozen-resumed"], range(3, 5))
    original, via_one = _flats_present(ckpt), _flats(chain / "ckpt-frozen-1")
    for key, value in original.items():
        assert torch.equal(value, via_one[key]), key


def _flats_present(ckpt: Path) -> dict:
    """Like _flats, with zeros where a rank saved no moments (`ckpt`: a root with `latest`, or one checkpoint)."""
    from safetensors import safe_open

    path = ckpt / (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else ckpt
    m = json.loads((path / "manifest.json").read_text())
    world, out = m["world_size"], {}
    files = [safe_open(str(path / rank_file(r, world)), framework="pt") for r in range(world)]
    for u in m["units"]:
        shard = u["padded_numel"] // world
        for label in ["master"] + (["exp_avg", "exp_avg_sq"] if u["moments"] else []):
            parts = [f.get_tensor(f"{u['uid']}/{label}") if f"{u['uid']}/{label}" in f.keys() else torch.zeros(shard)
                     for f in files]
            out[(u["uid"], label)] = torch.cat(parts)[:u["numel"]]
    return out


def test_resume_in_the_middle_of_a_gradient_accumulation(one_rank):
    """Saved after the first of two micro-batches: the partial gradient is in the checkpoint, and the
    resumed run finishes that step and the next ones as the uninterrupted run did, bit for bit."""
    tmp, runs = one_rank
    manifest = json.loads((tmp / "ckpt-accum" / "step-2" / "manifest.json").read_text())
    assert all(u["grad"] for u in manifest["units"] if any(u["used"]))
    _same(runs["full-accum"], runs["resumed-accum"], range(2, 5))


# ---- kills -------------------------------------------------------------------------------------
def _spawn(tmp: Path, name: str, **spec) -> subprocess.Popen:
    (tmp / "nvme").mkdir(exist_ok=True)
    spec.update(nvme=str(tmp / "nvme"), out=str(tmp / f"{name}.json"))
    (tmp / f"{name}.spec.json").write_text(json.dumps(spec))
    return subprocess.Popen([sys.executable, str(WORKER), str(tmp / f"{name}.spec.json")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _wait_for(cond, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("when", ["during_checkpoint_write", "during_step"])
def test_kill_9_loses_nothing_checkpointed(tmp_path, when, one_rank):
    """A run saved after step 3, killed with SIGKILL (its own process) while writing the next checkpoint, or in
    the middle of a step: `latest` names step-3, and the run resumed from it goes on as the uninterrupted run did,
    bit for bit; its next save removes the partial checkpoint."""
    full = one_rank[1]["full-fp32"]
    ckpt = tmp_path / "ckpt"
    if when == "during_checkpoint_write":  # a slow disk once step 3 is saved: each chunk of the next save takes 0.5 s
        proc = _spawn(tmp_path, "victim", steps=8, save_at=[3, 5], ckpt=str(ckpt), slow_after=[3, "checkpoint", 0.5])
        _wait_for(lambda: (ckpt / ".tmp-step-5").is_dir() and any((ckpt / ".tmp-step-5").iterdir()),
                  "the second checkpoint's first bytes")
    else:  # slow steps once step 3 is saved: killed in the middle of one
        proc = _spawn(tmp_path, "victim", steps=1000, save_at=[3], ckpt=str(ckpt), slow_after=[3, "optimizer", 0.05])
        assert proc.stdout.readline().strip() == "saved 3"
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert (ckpt / "latest").read_text().strip() == "step-3"  # the last complete checkpoint
    resumed = _worker(tmp_path, "resumed", steps=8, resume=True, save_at=[6], ckpt=str(ckpt))
    _same(full, resumed, range(3, 8))
    assert not any(p.name.startswith(".tmp") for p in ckpt.iterdir())  # the next save removed the partial one


# ---- in-process faults -------------------------------------------------------------------------
def _train(rt, model, opt, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        F.cross_entropy(model(ids).float().reshape(-1, VOCAB), ids.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def saved_run(tmp_path):
    """An open runtime with a trained TinyTransformer and a checkpoint of it under tmp/ckpt."""
    with offload.init(small_config()) as rt:
        model = TinyTransformer()
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        _train(rt, model, opt, 2)
        rt.save_checkpoint(tmp_path / "ckpt", extra={"cursor": 2})
        yield rt, model, opt, tmp_path / "ckpt"


def _unchanged(rt, model, before) -> bool:
    after = rt.full_state_dict(model)
    return all(torch.equal(before[k], after[k]) for k in before)


def test_corrupt_or_truncated_files_are_detected_before_any_write(saved_run):
    rt, model, opt, ckpt = saved_run
    _train(rt, model, opt, 1, seed=1)  # the live state now differs from the checkpoint's
    before = rt.full_state_dict(model)
    rank_path = ckpt / "step-2" / rank_file(0, 1)
    data = bytearray(rank_path.read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit
    rank_path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00000-of-00001.safetensors: sha256 differs .* corrupt"):
        rt.load_checkpoint(ckpt)
    rank_path.write_bytes(bytes(data[:-100]))
    with pytest.raises(CheckpointError, match=r"bytes, the manifest says .*truncated"):
        rt.load_checkpoint(ckpt)
    assert _unchanged(rt, model, before)
    manifest = json.loads((ckpt / "step-2" / "manifest.json").read_text())
    manifest["files"]["../../etc/passwd"] = manifest["files"].pop(rank_file(0, 1))
    (ckpt / "step-2" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"'\.\./\.\./etc/passwd', which is not a plain file name"):
        rt.load_checkpoint(ckpt)
    (ckpt / "latest").write_text("../elsewhere\n")
    with pytest.raises(CheckpointError, match="not a plain file name"):
        rt.load_checkpoint(ckpt)


def test_a_manifest_that_does_not_fit_is_refused_before_any_write(saved_run):
    """The manifest is not checksummed (the files it names are): a unit's padded size changed made the load read
    past each tensor's end and set that unit's weights to zeros; an unknown optimizer family was found after 23 of
    34 parameters were loaded. Both are refused before anything is written."""
    rt, model, opt, ckpt = saved_run
    _train(rt, model, opt, 1, seed=1)  # the live state now differs from the checkpoint's
    before = rt.full_state_dict(model)
    path = ckpt / "step-2" / "manifest.json"
    original = json.loads(path.read_text())
    for change, message in ((lambda m: m["units"][-1].update(padded_numel=16), r"padded to 16 over 1 rank"),
                            (lambda m: [u.update(optimizer_states="nonsense") for u in m["units"]], "nonsense")):
        manifest = json.loads(json.dumps(original))
        change(manifest)
        path.write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=message):
            rt.load_checkpoint(ckpt)
        assert _unchanged(rt, model, before)
    path.write_text(json.dumps(original))
    rt.load_checkpoint(ckpt)
    assert not _unchanged(rt, model, before)


def test_loads_back_exactly_and_returns_extra(saved_run):
    rt, model, opt, ckpt = saved_run
    saved = rt.full_state_dict(model)
    _train(rt, model, opt, 2, seed=5)
    assert rt.load_checkpoint(ckpt) == {"cursor": 2}
    assert _unchanged(rt, model, saved)
    with pytest.raises(CheckpointError, match="JSON-serializable"):
        rt.save_checkpoint(ckpt, extra={"bad": object()})


def test_a_removal_killed_halfway_never_costs_a_good_checkpoint(tmp_path):
    """keep_last=2. Pruning step-1 was killed after its rank file went (its manifest still there, its directory's
    time the newest): the next save kept it as "newest" and removed the good step-3. Now checkpoints age by their
    optimizer step, and each is renamed out of sight before it is removed."""
    with offload.init(small_config()) as rt:
        model = TinyTransformer()
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        root = tmp_path / "ckpt"
        for step in (1, 2, 3):
            _train(rt, model, opt, 1, seed=step)
            rt.save_checkpoint(root)
        (root / "step-1" / rank_file(0, 1)).unlink()  # the kill, halfway through removing step-1
        os.utime(root / "step-1")  # (the unlink made it the newest directory)
        _train(rt, model, opt, 1, seed=4)
        rt.save_checkpoint(root, keep_last=2)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and p.is_dir()) == ["step-3", "step-4"]
    assert not list(root.glob(".tmp-*"))


def test_disk_full_during_checkpoint_keeps_the_previous_one(saved_run):
    """The write fails part-way (here: EFBIG from RLIMIT_FSIZE, what a full disk's ENOSPC looks like to the
    writer): a clear error naming the file, no partial checkpoint, `latest` still on the previous one."""
    rt, model, opt, ckpt = saved_run
    before = rt.full_state_dict(model)
    _train(rt, model, opt, 1, seed=2)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, not kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, old_limit[1]))
    try:
        with pytest.raises(CheckpointError, match=r"rank 0: writing .*\.tmp-step-3/rank-00000-of-00001\.safetensors "
                                                  r"failed: .*free under .*previous checkpoint is untouched"):
            rt.save_checkpoint(ckpt)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-2"]
    assert rt.load_checkpoint(ckpt) == {"cursor": 2}
    assert _unchanged(rt, model, before)


def test_full_filesystem_during_checkpoint_keeps_the_previous_one(tmp_path):
    """A real ENOSPC: the checkpoint root on a 192 KiB tmpfs holds one checkpoint (125 KiB) but not two."""
    from _aio_support import mounted

    with mounted(tmp_path / "mnt", "tmpfs", "size=192k") as mnt:
        root = Path(mnt) / "ckpt"
        with offload.init(small_config()) as rt:
            model = TinyTransformer()
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            _train(rt, model, opt, 1)
            rt.save_checkpoint(root, extra={"cursor": 1})
            _train(rt, model, opt, 1)
            with pytest.raises(CheckpointError, match=r"writing .*rank-00000-of-00001\.safetensors failed: No space "
                                                      r"left on device .*free under"):
                rt.save_checkpoint(root)
            assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1"]
            assert rt.load_checkpoint(root) == {"cursor": 1}


def test_reserved_tags_a_writable_root_and_a_killed_resave(saved_run, tmp_path):
    rt, model, opt, ckpt = saved_run
    for tag in ("latest", "manifest.json", ".hidden"):
        with pytest.raises(CheckpointError, match="reserved"):
            rt.save_checkpoint(ckpt, tag=tag)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(CheckpointError, match=r"writable by other users \(mode 777\).*chmod go-w"):
        rt.save_checkpoint(shared)
    # a re-save of a tag killed between its two renames: the complete old copy is found as .old-<tag>
    (ckpt / "step-2").rename(ckpt / ".old-step-2")
    assert rt.load_checkpoint(ckpt) == {"cursor": 2}
    rt.save_checkpoint(ckpt, extra={"cursor": 3})  # step-2 again: sealed, then the old copy goes
    assert (ckpt / "step-2").is_dir() and not (ckpt / ".old-step-2").exists()
    assert rt.load_checkpoint(ckpt) == {"cursor": 3}


def test_aux_files_are_checksummed_and_exported(saved_run, tmp_path):
    rt, model, opt, ckpt = saved_run

    def add(directory):
        (directory / "config.json").write_text('{"model_type": "tiny"}')

    path = rt.save_checkpoint(ckpt, tag="with-aux", add_files=add)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["files"]["config.json"]["aux"] is True
    out = export_checkpoint(ckpt, tmp_path / "exported")
    assert json.loads((out / "config.json").read_text()) == {"model_type": "tiny", "dtype": "float32"}  # (its dtype)
    (path / "config.json").write_text('{"model_type": "evil"}')
    with pytest.raises(CheckpointError, match="config.json: sha256 differs"):
        export_checkpoint(ckpt, tmp_path / "exported2")


def test_refuses_symlinks_and_directories_of_other_users(saved_run, tmp_path):
    rt, model, opt, ckpt = saved_run
    link = tmp_path / "planted"
    link.symlink_to(tmp_path / "victim-target", target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic link"):
        rt.save_checkpoint(link)
    assert not (tmp_path / "victim-target").exists()
    if os.getuid() == 0:  # only root can make a directory owned by someone else
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        os.chown(foreign, 65534, 65534)
        with pytest.raises(CheckpointError, match="owned by uid 65534"):
            rt.save_checkpoint(foreign)
        os.chown(ckpt, 65534, 65534)
        with pytest.raises(CheckpointError, match="owned by uid 65534"):
            rt.load_checkpoint(ckpt)


def test_a_checkpoint_inside_the_swap_directory_is_refused(tmp_path):
    with offload.init(small_config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path))) as rt:
        model = TinyTransformer()
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        _train(rt, model, opt, 1)
        with pytest.raises(CheckpointError, match="inside the runtime's swap directory .* deleted when the runtime"):
            rt.save_checkpoint(rt.states.run_dir / "ckpt")


def test_another_model_is_refused_before_any_write(tmp_path, saved_run):
    _, _, _, ckpt = saved_run
    with offload.init(small_config()) as rt:
        model = TinyTransformer(d=24)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        before = rt.full_state_dict(model)
        with pytest.raises(CheckpointError, match=r"does not fit this model: unit '<root>': model emb.weight "
                                                  r"\[32, 24\] but checkpoint emb.weight \[32, 16\]"):
            rt.load_checkpoint(ckpt)
        assert _unchanged(rt, model, before)
        del opt


def test_a_load_that_fails_on_one_rank_fails_on_every_rank_at_once(tmp_path):
    """Rank 1 loads its node's copy of the checkpoint, whose manifest is corrupt (rank 0's copy is sound): its check
    fails before the ranks' first collective of the load. Every rank raises at once naming rank 1 and its reason
    (before, rank 0 waited collective_timeout in the verdict's all-gather for a rank that had left), and neither
    rank's state changed."""
    from zero_common import run_rank_script

    code = textwrap.dedent(f"""
        import json, os, shutil, sys, time
        import torch
        import torch.nn.functional as F
        sys.path.insert(0, {str(TESTS)!r})
        import offload
        from zero_common import SEQ, VOCAB, TinyTransformer, small_config

        def step(model, opt, s):
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(s))
            F.cross_entropy(model(ids).float().reshape(-1, VOCAB), ids.reshape(-1)).backward()
            opt.step(); opt.zero_grad()

        torch.set_num_threads(1)
        tmp, out = {str(tmp_path)!r}, {{}}
        with offload.init(small_config(agreement_timeout="10s", collective_timeout="60s")) as rt:
            model = TinyTransformer()
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            step(model, opt, 0)
            rt.save_checkpoint(os.path.join(tmp, "ckpt"))
            step(model, opt, 1)  # the live state now differs from the checkpoint's
            before = rt.full_state_dict(model)
            root = os.path.join(tmp, "ckpt")
            if rt.rank == 1:  # this node's copy, its manifest corrupt
                root = os.path.join(tmp, "node1")
                shutil.copytree(os.path.join(tmp, "ckpt"), root)
                with open(os.path.join(root, "step-1", "manifest.json"), "w") as f:
                    f.write("{{")
            t0 = time.monotonic()
            try:
                rt.load_checkpoint(root)
                out["error"] = None
            except offload.CheckpointError as exc:
                out["error"] = str(exc)
            out["waited"] = time.monotonic() - t0
            after = rt.full_state_dict(model)
            out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
            out["steps"] = rt.stats()["steps"]
        with open(os.path.join(tmp, f"rank{{rt.rank}}.json"), "w") as f:
            json.dump(out, f)
        """)
    run_rank_script(code, tmp_path, timeout=300)
    for r in (0, 1):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert out["error"] is not None and out["error"].startswith(
            f"loading {tmp_path / 'ckpt' if r == 0 else tmp_path / 'node1'} failed on 1 of 2 ranks, so on every rank "
            "(nothing was loaded): rank 1: "), out["error"]
        assert "manifest.json: not valid JSON" in out["error"] and "the checkpoint is corrupt" in out["error"]
        assert out["waited"] < 30.0, out  # not collective_timeout (60 s here, 10 minutes by default)
        assert out["unchanged"] and out["steps"] == 2, out

"""Config.activations (offload/zero/activations.py): the tensors autograd saves in the forward wait for the
backward in the cpu tier or an nvme swap file. What is asserted: losses and final weights bit for bit those of the
same run without offload (a transformers Llama with and without gradient checkpointing, fp32 and bf16, gradient
accumulation, the synchronous path, 2 ranks, a slow activation lane), that something really moved and nothing is
left in the store after the step, the budgets (a cpu tier with no room keeps the tensors where they are and still
trains), swap slots reused step after step, a forward without a backward cleaned up, bad settings named, and a
killed run's activation swap removed by the next start, and the compute device's peak against block sizes (flat
in depth when offloaded, also with a slow lane)."""
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import offload  # noqa: E402
from offload import inject  # noqa: E402
from offload.device_memory import take_peak_allocated  # noqa: E402
from offload.store import host_pool  # noqa: E402
from offload.store.swap_file import page_bytes  # noqa: E402
from offload.telemetry import Queue  # noqa: E402
from offload.zero.activations import KEEP_LAST, OUT_WINDOW, READ_AHEAD, ActivationKey  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import run_rank_script  # noqa: E402


def llama(layers: int = 3, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2))


def checkpoint_blocks(model, reentrant: bool = False) -> None:
    """transformers' activation checkpointing (non-reentrant unless asked: DeepSpeed's function and transformers
    4.x's default are reentrant), by whichever name this version has."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def batches(n: int, rank: int = 0, seq: int = 64):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 300, (4, seq), generator=g) for _ in range(n)]


def train(tmp, activations="none", checkpointing=True, compute_dtype="fp32", accumulate=1, steps=3, pipeline=True,
          cpu_budget="256MiB", min_size="16KiB", rank=0, layers=3, hidden=64, seq=64):
    """Losses, final fp32 weights and rt.stats() of `steps` AdamW steps of a small Llama (batch 4 x seq);
    checkpointing: True, False, or "reentrant"."""
    cfg = offload.Config(params="cpu", optimizer="nvme", nvme_path=str(tmp), cpu_budget=cpu_budget,
                         device_budget="256MiB", compute_dtype=compute_dtype, pipeline=pipeline,
                         activations=activations, activations_min_size=min_size)
    with offload.init(cfg) as rt:
        model = llama(layers, hidden)
        if checkpointing:
            checkpoint_blocks(model, reentrant=checkpointing == "reentrant")
        model.train()
        opt = offload.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        losses = []
        data = batches(steps * accumulate, rank, seq)
        for step in range(steps):
            for micro in range(accumulate):
                ids = data[step * accumulate + micro].to(rt.device)
                loss = model(input_ids=ids, labels=ids).loss
                (loss / accumulate).backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        weights = rt.full_state_dict(model)
        stats = rt.stats()
    return losses, weights, stats


def assert_same(run, ref):
    assert run[0] == ref[0], (run[0], ref[0])
    bad = [k for k in ref[1] if not torch.equal(run[1][k], ref[1][k])]
    assert not bad, bad[:5]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The runs without offload, by (checkpointing, compute dtype, accumulation)."""
    cache = {}

    def get(checkpointing=True, compute_dtype="fp32", accumulate=1):
        key = (checkpointing, compute_dtype, accumulate)
        if key not in cache:
            cache[key] = train(tmp_path_factory.mktemp("ref"), "none", checkpointing, compute_dtype, accumulate)
        return cache[key]
    return get


@pytest.mark.parametrize("home", ["cpu", "nvme"])
@pytest.mark.parametrize("checkpointing", [True, "reentrant", False], ids=["ckpt", "ckpt-reentrant", "saved"])
def test_offloaded_activations_train_bitwise_as_without(tmp_path, reference, home, checkpointing):
    run = train(tmp_path, home, checkpointing)
    assert_same(run, reference(checkpointing))
    acts = run[2]["activations"]
    assert acts["home"] == home and acts["moved_tensors"] > 0 and acts["kept_bytes"] == 0
    assert acts["in_store"] == 0  # every shard removed once it came back
    if checkpointing:  # the 3 blocks' inputs each step (the rotary cos/sin, saved by every block, moved once)
        assert acts["moved_tensors"] <= 3 * (3 + 2 + 4)
    if home == "nvme":
        assert run[2]["nvme_written_bytes"] > ref_nvme(reference(checkpointing))


def ref_nvme(ref) -> int:
    return ref[2]["nvme_written_bytes"]


@pytest.mark.parametrize("case", ["bf16", "accumulate", "sync"])
def test_bf16_accumulation_and_the_synchronous_path(tmp_path, reference, case):
    kw = {"bf16": dict(compute_dtype="bf16"), "accumulate": dict(accumulate=2), "sync": dict(pipeline=False)}[case]
    run = train(tmp_path, "nvme", **kw)
    kw.pop("pipeline", None)
    assert_same(run, reference(**kw))
    assert run[2]["activations"]["moved_tensors"] > 0 and run[2]["activations"]["in_store"] == 0


@pytest.mark.parametrize("queue", [Queue.ACTIVATION, Queue.NVME_WRITE, Queue.NVME_READ])
def test_a_slow_activation_copy_or_disk_changes_nothing(tmp_path, reference, queue):
    """Each copy out / back (or each swap write / read) 20 ms late: the forward runs ahead of the copies out and
    the backward waits for the copies back, and the numbers are the same."""
    with inject.delay(queue, 0.02):
        run = train(tmp_path, "nvme", steps=2)
    ref = reference()
    assert run[0] == ref[0][:2]
    acts = run[2]["activations"]
    assert acts["moved_tensors"] > 0 and acts["in_store"] == 0
    if queue is Queue.ACTIVATION:
        assert acts["wait_s"] > 0  # the backward did wait for a tensor coming back


def test_a_full_cpu_tier_keeps_the_tensors_where_they_are(tmp_path, reference):
    """A cpu budget that the states' working set fills: nothing moves (no wait, no deadlock), it trains the same,
    and the cpu tier's peak stays within its budget."""
    run = train(tmp_path, "cpu", cpu_budget="1280KiB", min_size="4KiB")
    assert_same(run, reference())
    acts, peak = run[2]["activations"], run[2]["peak_resident_bytes"]["cpu"]
    assert acts["kept_bytes"] > 0 and acts["in_store"] == 0
    assert peak <= run[2]["budgets"]["cpu"]


# The compute device's peak against block sizes (FSDP2's memory tests). With checkpointing, what a block leaves
# saved for the backward is its input: BLOCK_INPUT bytes (batch 4 x seq x hidden, fp32), a pool size class of its
# own above the host pool's 128 KiB floor, so on the CPU the pool counts it exactly as CUDA's allocator would.
PEAK_SEQ, PEAK_HIDDEN = 256, 128
BLOCK_INPUT = 4 * PEAK_SEQ * PEAK_HIDDEN * 4


def allocated(device) -> int:
    """What the compute device's allocator has handed out now (CPU: the host pool's blocks in use)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else host_pool.stats()["in_use_bytes"]


def device_peaks(tmp, activations, layers, slow_lane=0.0, steps=3):
    """(forward, backward) peaks of the compute device's allocator in the last step, above what it held when the
    step began: the forward's, and the backward's with the optimizer step (its window starts where the forward's
    ends). Not above what it held before the run: the model states the device keeps between steps (on a GPU the
    device tier's gradient shards, one per block) grow with depth too, and they are not the activations'."""
    cfg = offload.Config(params="cpu", optimizer="nvme", nvme_path=str(tmp), cpu_budget="256MiB",
                         device_budget="256MiB", activations=activations, activations_min_size="256KiB")
    with offload.init(cfg) as rt, inject.delay(Queue.ACTIVATION, slow_lane) if slow_lane else contextlib.nullcontext():
        if take_peak_allocated(rt.device) is None:
            pytest.skip("the host pool is not torch's CPU allocator here (no C++ extension)")
        model = llama(layers, PEAK_HIDDEN)
        checkpoint_blocks(model)
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        for ids in batches(steps, seq=PEAK_SEQ):
            ids = ids.to(rt.device)
            rt.quiesce()  # the lanes quiet: the last step's transients (a reduce's full gradient) out of `base`
            take_peak_allocated(rt.device)  # the forward's window starts here
            base = allocated(rt.device)
            loss = model(input_ids=ids, labels=ids).loss
            forward = take_peak_allocated(rt.device) - base
            loss.backward()
            opt.step()
            opt.zero_grad()
            backward = take_peak_allocated(rt.device) - base
        acts = rt.stats()["activations"]
    if activations != "none":
        assert acts["moved_tensors"] > 0 and acts["kept_bytes"] == 0, acts
    return forward, backward


def measure_device_peaks(tmp_path) -> dict:
    """{(activations, layers): (forward, backward) peaks} of the runs the device-peak test compares, after one run
    whose peaks are dropped: what a process allocates once and keeps (a GPU's cuBLAS workspace) lands there, not in
    the first compared run."""
    (tmp_path / "warm-up").mkdir()
    device_peaks(tmp_path / "warm-up", "none", 2)
    peaks = {}
    for activations, layers, slow in (("none", 2, 0), ("none", 8, 0), ("cpu", 8, 0), ("nvme", 8, 0.02)):
        (tmp_path / f"{activations}{layers}").mkdir()
        peaks[activations, layers] = device_peaks(tmp_path / f"{activations}{layers}", activations, layers, slow)
    return peaks


def check_device_peaks(peaks: dict) -> None:
    unit = sum(p.numel() for p in llama(1, PEAK_HIDDEN).model.layers[0].parameters()) * 4  # a block's fp32 params
    for phase, name in enumerate(("forward", "backward")):
        grown = peaks["none", 8][phase] - peaks["none", 2][phase]
        assert grown >= 6 * BLOCK_INPUT - BLOCK_INPUT // 2, (name, peaks)  # each block's input held, 6 more blocks
        held = OUT_WINDOW if phase == 0 else READ_AHEAD
        # (8 layers: one more block gathered ahead)
        bound = peaks["none", 2][phase] + held * BLOCK_INPUT + unit
        for home in ("cpu", "nvme"):
            assert peaks[home, 8][phase] <= bound, (name, home, peaks)


def test_offloaded_activations_hold_the_device_peak_whatever_the_depth(tmp_path):
    """Left in place, a checkpointed model's device peak grows by a block's input per layer, in the forward and in
    the backward. Offloaded (cpu tier; nvme with a slow lane), 8 layers peak within a 2-layer model's in-place peak
    plus what the offloader may hold by design (OUT_WINDOW originals waiting for their copies out in the forward,
    READ_AHEAD tensors back early in the backward) and one block's parameters (a deeper model has one more block
    gathered ahead). The slow lane is what the forward's window is for: without it the forward piles up every
    block's input while the copies lag."""
    check_device_peaks(measure_device_peaks(tmp_path))


@pytest.mark.parametrize("delay", [None, Queue.NVME_WRITE])
def test_auto_fills_the_cpu_tier_then_spills_to_the_swap_file(tmp_path, reference, delay):
    """Config.activations="auto" with a cpu budget that holds about half of a step's saved block inputs beside the
    room its swap writes stage through: the first ones wait in the cpu tier, the rest in the swap file, bit for bit
    (also with the disk's writes slowed), nothing kept, nothing left, the cpu tier within its budget."""
    with inject.delay(delay, 0.01) if delay else contextlib.nullcontext():
        run = train(tmp_path, "auto", cpu_budget="5632KiB", min_size="4KiB")
    assert_same(run, reference())
    acts = run[2]["activations"]
    assert acts["home"] == "auto" and acts["kept_bytes"] == 0 and acts["in_store"] == 0
    assert 0 < acts["moved_to_nvme_bytes"] < acts["moved_bytes"], acts  # both tiers took some
    assert run[2]["peak_resident_bytes"]["cpu"] <= run[2]["budgets"]["cpu"]
    # without a swap directory "auto" is the cpu tier alone
    cfg = offload.Config(params="cpu", optimizer="cpu", cpu_budget="256MiB", device_budget="256MiB",
                         activations="auto", activations_min_size="4KiB")
    with offload.init(cfg) as rt:
        model = llama()
        checkpoint_blocks(model)
        ids = batches(1)[0]
        model(input_ids=ids, labels=ids).loss.backward()
        acts = rt.stats()["activations"]
    assert acts["moved_bytes"] > 0 and acts["moved_to_nvme_bytes"] == 0


def test_resident_states_leave_the_activations_their_share(tmp_path):
    """States on nvme and a cpu budget they could fill: once the first step is traced the schedule keeps states
    resident in the room the activations do not need (what the forwards held), so every step's saved tensors
    still move (none kept on the device), and the numbers are those of the run without offload."""
    def run(activations):
        cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), cpu_budget="3MiB",
                             device_budget="256MiB", activations=activations, activations_min_size="4KiB")
        with offload.init(cfg) as rt:
            model = llama()
            checkpoint_blocks(model)
            opt = offload.AdamW(model.parameters(), lr=1e-3)
            losses, per_step = [], []
            for ids in batches(4):
                before = dict(rt.stats().get("activations") or {"moved_bytes": 0, "kept_bytes": 0})
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                acts = rt.stats().get("activations")
                if acts:
                    per_step.append((acts["moved_bytes"] - before["moved_bytes"], acts["kept_bytes"] - before["kept_bytes"]))
            resident = len(rt.states.resident_keys())
            return losses, rt.full_state_dict(model), per_step, resident

    ref, got = run("none"), run("cpu")
    assert got[0] == ref[0] and all(torch.equal(got[1][k], ref[1][k]) for k in ref[1])
    assert got[3] > 0  # states do stay resident beside them
    assert all(moved > 0 and kept == 0 for moved, kept in got[2]), got[2]
    assert len({moved for moved, _ in got[2][2:]}) == 1, got[2]  # the same every step once the forwards repeat


def test_swap_slots_are_reused_step_after_step(tmp_path):
    cfg = offload.Config(params="cpu", optimizer="cpu", nvme_path=str(tmp_path), cpu_budget="64MiB",
                         device_budget="64MiB", activations="nvme", activations_min_size="16KiB")
    with offload.init(cfg) as rt:
        model = llama()
        checkpoint_blocks(model)
        model.train()
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        swap = rt.states.store._swap
        sizes = []
        for ids in batches(3):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            rt.quiesce()
            sizes.append(swap["activations"].size)
        assert sizes[0] > 0 and sizes[1] == sizes[0] == sizes[2]  # the same slots each step: the file does not grow
        assert rt.stats()["activations"]["in_store"] == 0
        assert swap["activations"].free_bytes_in_file == swap["activations"].size


def test_a_forward_without_backward_is_cleaned_up(tmp_path):
    """The saved tensors of a graph dropped unused leave the store once autograd lets them go (with this runtime,
    when the next forward starts). A plain torch model: transformers' Llama keeps a dropped forward's graph alive
    (in plain PyTorch too: 124 of its 127 saved tensors outlive `del loss`)."""
    cfg = offload.Config(params="cpu", optimizer="cpu", nvme_path=str(tmp_path), cpu_budget="64MiB",
                         device_budget="64MiB", activations="nvme", activations_min_size="16KiB")
    with offload.init(cfg) as rt:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                                      for _ in range(4)])
        x = torch.randn(64, 256)
        model(x).sum().backward()
        loss = model(x).sum()
        rt.quiesce()
        assert rt.activations.in_store() >= 4
        del loss
        model(x).sum().backward()
        rt.quiesce()
        assert rt.activations.in_store() == 0


def no_saved_tensor_hooks_open() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("how", ["built inside, wrapped by hand", "built inside, wrapped at first use",
                                 "built outside", "a forward that raises"])
def test_the_hooks_are_open_during_the_forward_only(tmp_path, how):
    """Every forward of a wrapped model opens the saved-tensor hooks once and closes them: a model built inside
    the block and wrapped by hand (as offload finetune does) opened them twice at its first forward and closed
    them once, and every later forward in the process, with or without offload, packed into a closed store."""
    cfg = offload.Config(params="cpu", optimizer="cpu", nvme_path=str(tmp_path), cpu_budget="64MiB",
                         device_budget="64MiB", activations="nvme", activations_min_size="16KiB")
    model = llama(2) if how == "built outside" else None
    with offload.init(cfg) as rt:
        if model is None:
            model = llama(2)
        if how != "built inside, wrapped at first use":
            rt.wrap(model)
        ids = batches(1)[0]
        if how == "a forward that raises":
            with pytest.raises(IndexError):
                model(input_ids=ids + 10_000)  # past the vocabulary: the embedding raises inside the forward
            assert no_saved_tensor_hooks_open()
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            assert no_saved_tensor_hooks_open()
        assert rt.stats()["activations"]["moved_tensors"] > 0
    assert no_saved_tensor_hooks_open()


def test_the_store_removes_a_shard_and_reuses_its_room(tmp_path):
    from offload.store import LeaseMode, StoreConfig, TieredStore

    with TieredStore(StoreConfig(device="cpu", device_budget="1MiB", cpu_budget="1MiB", nvme_budget="16MiB",
                                 nvme_path=str(tmp_path), lock_memory=False)) as st:
        for rnd in range(3):
            for home in ("cpu", "nvme"):
                key = ActivationKey(rnd, 0 if home == "cpu" else 1)
                st.register(key, 50_000, torch.float32, home=home, tier_class="activations", zero=False).result()
                lease = st.lease(key, "cpu", LeaseMode.OVERWRITE)
                lease.wait().fill_(rnd + 0.5)
                lease.release()
                back = st.lease(key, "cpu", LeaseMode.READ)
                assert torch.all(back.wait() == rnd + 0.5)
                back.release()
                st.unregister(key).result()
                with pytest.raises(KeyError):
                    st.info(key)
            assert st.stats()["cpu"]["bytes_in_use"] == 0 and st.stats()["nvme"]["bytes_in_use"] == 0
        assert st._swap["activations"].size == page_bytes(200_000)  # one slot, reused every round


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"Config.activations: 'gpu' is not one of"):
        offload.Config(activations="gpu")
    with pytest.raises(ValueError, match=r"Config.nvme_path: required because activations='nvme'"):
        offload.Config(activations="nvme")
    with pytest.raises(ValueError, match="activations_min_size"):
        offload.Config(activations="cpu", activations_min_size="lots")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """One 2-rank launch for the two tests below (each writes its own files): with and without offloaded
    activations from one init (bitwise/), and ranks whose sequences differ in length (lengths/)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    for sub in ("bitwise/a", "bitwise/b", "lengths"):
        (tmp / sub).mkdir(parents=True)
    code = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import offload
        from test_activation_offload import batches, checkpoint_blocks, llama, train
        rank = int(os.environ["RANK"])
        torch.distributed.init_process_group("gloo")  # one group for every run (each runtime makes its own sub-groups)
        # bitwise: the same training without and with the activations on nvme
        ref = train({str(tmp / 'bitwise' / 'a')!r}, "none", rank=rank)
        run = train({str(tmp / 'bitwise' / 'b')!r}, "nvme", rank=rank)
        same = run[0] == ref[0] and all(torch.equal(run[1][k], ref[1][k]) for k in ref[1])
        with open(os.path.join({str(tmp / 'bitwise')!r}, f"rank{{rank}}.txt"), "w") as f:  # (stdouts interleave)
            f.write(f"RANK {{rank}} SAME {{same}} MOVED {{run[2]['activations']['moved_tensors']}}")
        # lengths: rank 0's sequences 64 tokens long, rank 1's 16
        lengths = {str(tmp / 'lengths')!r}
        cfg = offload.Config(params="nvme", optimizer="nvme", nvme_path=lengths, cpu_budget="3MiB",
                             device_budget="256MiB", activations="cpu", activations_min_size="4KiB")
        with offload.init(cfg) as rt:
            model = llama()
            checkpoint_blocks(model)
            opt = offload.AdamW(model.parameters(), lr=1e-3)
            for ids in batches(4, rank, seq=64 if rank == 0 else 16):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            moved = rt.stats()["activations"]["moved_bytes"]
        with open(os.path.join(lengths, f"rank{{rank}}.txt"), "w") as f:
            f.write(str(moved))
    """)
    run_rank_script(code, tmp)
    return tmp


def test_two_ranks_train_bitwise_as_without(two_ranks):
    lines = [(two_ranks / "bitwise" / f"rank{r}.txt").read_text() for r in range(2)]
    assert all(" SAME True " in x for x in lines), lines
    assert all(int(x.split()[-1]) > 0 for x in lines), lines


def test_a_killed_runs_activation_swap_is_removed_by_the_next_start(tmp_path, caplog):
    """kill -9 between a forward and its backward, activations on nvme: the swap file holding them is in the run's
    own directory, which the next offload.init under the same nvme_path removes (its owner is dead)."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import offload
        from test_activation_offload import batches, llama
        cfg = offload.Config(params="cpu", optimizer="cpu", nvme_path={str(tmp_path)!r}, cpu_budget="64MiB",
                             device_budget="64MiB", activations="nvme", activations_min_size="16KiB")
        with offload.init(cfg) as rt:
            model = llama()
            ids = batches(1)[0]
            loss = model(input_ids=ids, labels=ids).loss
            rt.quiesce()
            print("STORED", rt.activations.in_store(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    script = tmp_path / "killed.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert int(next(x for x in out.stdout.splitlines() if x.startswith("STORED")).split()[1]) > 0
    left = [p for p in tmp_path.glob("offload-*") if p.is_dir()]
    assert left and any(p.glob("*activations*.swap") for p in left)
    with caplog.at_level("WARNING", logger="offload"):
        with offload.init(offload.Config(params="cpu", optimizer="cpu", nvme_path=str(tmp_path),
                                         cpu_budget="64MiB", device_budget="64MiB")):
            pass
    assert "left by a run that died" in caplog.text
    assert not [p for p in tmp_path.glob("offload-*") if p.is_dir()]


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_large_tensors_move_in_pieces_through_a_bounded_window(tmp_path, monkeypatch, home):
    """Saved tensors of 1 MiB in 64 KiB pieces (the staging slot with chunk_size 64KiB), 20 ms per piece's write:
    the lane keeps at most WRITE_WINDOW pieces in flight to nvme; the numbers are those without offload."""
    from offload.zero import activations

    monkeypatch.setattr(activations, "MIN_PIECE_BYTES", 64 << 10)

    def run(act):
        cfg = offload.Config(params="cpu", optimizer="cpu", nvme_path=str(tmp_path), cpu_budget="64MiB",
                             device_budget="64MiB", chunk_size="64KiB", activations=act, activations_min_size="256KiB")
        with offload.init(cfg) as rt:
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU())
                                          for _ in range(3)])
            opt = offload.AdamW(model.parameters(), lr=1e-3)
            x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
            losses = []
            for _ in range(2):
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses, rt.full_state_dict(model), rt.stats()

    ref = run("none")
    with inject.delay(Queue.NVME_WRITE, 0.02):
        got = run(home)
    assert_same(got, ref)
    acts = got[2]["activations"]
    # each block's input and GELU's: 6 in the first step, and in the second all but the KEEP_LAST the backward
    # needs first
    assert acts["moved_tensors"] >= 6 + 6 - KEEP_LAST and acts["in_store"] == 0
    assert acts["left_last_bytes"] == KEEP_LAST * 256 * 1024 * 4
    assert got[2]["peak_resident_bytes"]["cpu"] <= got[2]["budgets"]["cpu"]


# ---- a forward under no_grad, a failed copy back, a tensor changed in place, a forward cut short -----------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)

    def forward(self, x):
        return torch.relu(self.linear(x))


class _Net(torch.nn.Module):
    """8 checkpointed blocks: each block's input (256 KiB) is saved, and moves."""

    def __init__(self, interrupt_at: int | None = None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(8))
        self.interrupt_at = interrupt_at  # raise KeyboardInterrupt before this block, once

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for i, block in enumerate(self.blocks):
            if i == self.interrupt_at:
                self.interrupt_at = None
                raise KeyboardInterrupt
            x = checkpoint(block, x, use_reentrant=False)
        return x


def _cpu_config(**kw):
    return offload.Config(params="cpu", optimizer="cpu", activations="cpu", cpu_budget="256MiB", device_budget="64MiB",
                          activations_min_size="16KiB", **kw)


def _moved_in_a_step(rt, model, x) -> int:
    before = rt.stats()["activations"]["moved_tensors"]
    model(x).sum().backward()
    rt.quiesce()
    return rt.stats()["activations"]["moved_tensors"] - before


def test_an_eval_forward_or_another_model_between_steps_leaves_the_offload_as_it_was():
    """The forward's last KEEP_LAST tensors stay, counted by the model's previous forward under grad: an eval
    forward under no_grad (nothing saved) counted 0 and the next step moved nothing at all; two models used in
    turn counted each other's."""
    torch.manual_seed(0)
    with offload.init(_cpu_config()) as rt:
        first, second = _Net(), _Net()
        rt.wrap(first)
        rt.wrap(second)
        x = torch.randn(256, 256, requires_grad=True)
        steady = [_moved_in_a_step(rt, first, x) for _ in range(2)][1]
        assert steady == 8 - KEEP_LAST  # the 8 blocks' inputs, less the last KEEP_LAST
        with torch.no_grad():
            first(x)
        assert _moved_in_a_step(rt, first, x) == steady
        assert _moved_in_a_step(rt, second, x) == 8  # its first forward: nothing counted yet
        assert _moved_in_a_step(rt, first, x) == steady
        assert rt.activations.in_store() == 0 and no_saved_tensor_hooks_open()


def test_a_failed_copy_back_is_raised_once_and_leaves_nothing_behind():
    """A copy back that cannot allocate (the device full at the backward's peak) raises torch.OutOfMemoryError
    where autograd asks; the user skips the batch and trains on. Its shards and the step's graph are let go (the
    error no longer holds the graph through the ticket), and the next drain does not raise it again."""
    import gc

    torch.manual_seed(0)
    with offload.init(_cpu_config()) as rt:
        model = _Net()
        rt.wrap(model)
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(256, 256, requires_grad=True)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        rt.quiesce()
        baseline = rt.states.store.stats()["cpu"]["bytes_in_use"]
        with inject.out_of_memory_at(inject.Site.ACTIVATION_BACK):
            with pytest.raises(torch.OutOfMemoryError):
                model(x).sum().backward()
        opt.zero_grad()
        rt.quiesce()  # the failure was the backward's, raised there: not again here
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        rt.quiesce()
        gc.collect()
        model(x).sum().backward()  # (flushes what autograd dropped)
        opt.zero_grad()
        rt.quiesce()
        assert rt.activations.in_store() == 0
        assert rt.states.store.stats()["cpu"]["bytes_in_use"] == baseline


class _ChangesASavedTensor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)

    def forward(self, x):
        h = self.linear(x)
        y = h * h  # saves h
        h.add_(1.0)  # changes it: the backward would use other values than the forward did
        return y


@pytest.mark.parametrize("moved", [True, False], ids=["moved", "stays"])
def test_a_saved_tensor_changed_in_place_is_refused_as_torch_refuses_it(moved):
    """Saved-tensor hooks turn torch's version check off; the offloader checks in its place. A tensor it leaves:
    as torch. A tensor it moves, changed before its copy out finished (here: the lane slowed 0.5 s a piece, the
    change comes at once), so the copy may hold either value: refused. (Changed after a finished copy, with the
    original gone by the backward, the copy holds the values the forward used, and the backward uses them.)"""
    torch.manual_seed(0)
    x = torch.randn(256, 256)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _ChangesASavedTensor()(x).sum().backward()  # plain torch
    cfg = _cpu_config() if moved else offload.Config(params="cpu", optimizer="cpu", activations="cpu",
                                                     cpu_budget="256MiB", device_budget="64MiB",
                                                     activations_min_size="1GiB")
    with offload.init(cfg) as rt, inject.delay(Queue.ACTIVATION, 0.5 if moved else 0.0):
        model = _ChangesASavedTensor()
        rt.wrap(model)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            model(x).sum().backward()
        rt.quiesce()
        assert (rt.stats()["activations"]["moved_tensors"] > 0) == moved


class _KeepsTheBaseOfASavedView(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)
        self.kept = None

    def forward(self, x):
        base = self.linear(x)
        v = base[:128]  # a view: `v * v` saves it, and it dies here; its base lives on
        self.kept = base
        return (v * v).sum()


def test_changes_in_place_after_the_copy_out_are_refused_as_torch_refuses_them():
    """Two changes torch refuses that a moved tensor let through with the values from before (the backward then
    trained on other values than the forward saw): a saved tensor changed between two backwards of a retained
    graph (only the first unpack was checked), and a saved view changed through its base after the view died
    (only the view was watched; they share one version counter). Both are made after the copy out finished."""
    torch.manual_seed(0)
    with offload.init(_cpu_config()) as rt:
        model = rt.wrap(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
        h = torch.randn(256, 256).requires_grad_() * 1.0  # saved by the first Linear (its weight's gradient)
        loss = model(h).sum()
        loss.backward(retain_graph=True)
        assert rt.stats()["activations"]["moved_tensors"] > 0
        with torch.no_grad():
            h.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    with offload.init(_cpu_config()) as rt:
        model = rt.wrap(_KeepsTheBaseOfASavedView())
        loss = model(torch.randn(256, 256))
        rt.quiesce()  # the copy out is over: the stored bytes are the forward's
        assert rt.stats()["activations"]["moved_tensors"] > 0
        with torch.no_grad():
            model.kept.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_forward_cut_short_by_keyboard_interrupt_leaves_no_hooks_open():
    """torch runs always-call forward hooks for an Exception only: after a KeyboardInterrupt in the forward the
    hooks stayed open for the rest of the process and nothing moved any more. The model's next forward starts
    the block afresh."""
    torch.manual_seed(0)
    with offload.init(_cpu_config()) as rt:
        model = _Net(interrupt_at=4)
        rt.wrap(model)
        x = torch.randn(256, 256, requires_grad=True)
        with pytest.raises(KeyboardInterrupt):
            model(x)
        steady = [_moved_in_a_step(rt, model, x) for _ in range(3)]
        assert no_saved_tensor_hooks_open()
        assert steady[1] == steady[2] == 8 - KEEP_LAST
        assert rt.activations.in_store() == 0


def test_two_ranks_with_sequences_of_other_lengths_issue_the_same_collectives(two_ranks):
    """Rank 0's batches are 64 tokens long and rank 1's 16 (a length-grouped sampler, the last batch of an
    epoch): their saved activations, and with them the cpu room the schedule leaves the offloaded activations
    beside the resident states, differ. What each rank gathers and reduces must not: the ranks compare it at the
    end of every backward (collectives/divergence.py) and their recorded sequences are compared at exit
    (run_rank_script, in the two_ranks fixture)."""
    moved = [int((two_ranks / "lengths" / f"rank{r}.txt").read_text()) for r in range(2)]
    assert moved[0] > moved[1] > 0, moved  # the ranks' activations did differ

"""`offload plan`: the memory arithmetic against hand-computed figures, the step model on cases worked by
hand, and the command on the issue's 70B example."""
import json
import re

import pytest

from offload.cli import main
from offload.plan.memory import PAPER, RUNTIME, Placement, Workload, activation_bytes, tier_bytes, zero_stage_bytes
from offload.plan.model_spec import PRESETS, ModelSpec, model_from
from offload.plan.step_time import Machine, predict


def test_parameter_counts_of_the_presets():
    assert PRESETS["llama-7b"].params == 6_738_415_616  # LLaMA-7B as published
    assert PRESETS["llama-13b"].params == 13_015_864_320
    assert PRESETS["llama-70b"].params == 68_976_648_192  # Llama-2-70B (GQA, 8 KV heads)
    assert PRESETS["llama3-8b"].params == 8_030_261_248


def test_bytes_per_parameter_and_the_70b_total():
    assert PAPER.total == 16 and RUNTIME.total == 18  # fp32 gradient shards here
    assert zero_stage_bytes(70_000_000_000, 1, 0) == 1.12e12  # 70B -> 1.12 TB of model states


def test_zero_stages_match_the_papers_figure_1():
    # ZeRO (Rajbhandari et al. 2020), Figure 1: 7.5B parameters, 64 ranks, K = 12
    psi, nd = 7.5e9, 64
    assert [round(zero_stage_bytes(psi, nd, s) / 1e9, 2) for s in range(4)] == [120.0, 31.41, 16.64, 1.88]


def test_activation_arithmetic():
    m = ModelSpec("t", vocab=1000, hidden=64, intermediate=256, layers=4, heads=4, kv_heads=4)
    w = Workload(micro_batch=2, seq_len=128, checkpointing=False)
    sbh = 128 * 2 * 64
    assert activation_bytes(m, w) == 4 * 34 * sbh + 6 * 128 * 2 * 1000
    ck = Workload(micro_batch=2, seq_len=128, checkpointing=True)
    assert activation_bytes(m, ck) == 4 * 2 * sbh + 34 * sbh + 6 * 128 * 2 * 1000


def test_tiers_put_each_state_where_the_placement_says():
    m = PRESETS["llama-7b"]
    t = tier_bytes(m, Workload(), 8, Placement("cpu", "nvme"))
    n = m.params / 8
    assert t["cpu"]["params"] == 2 * n
    assert (t["nvme"]["grads"], t["nvme"]["master"], t["nvme"]["moments"]) == (4 * n, 4 * n, 8 * n)
    assert "params" not in t["device"] and t["cpu"]["staging"] > 0


def test_step_model_by_hand():
    """One rank, a model of 1e9 params (embedding + head, no layers: no attention term), one drive: every
    term worked by hand."""
    m = ModelSpec("x", vocab=500_000_000, hidden=1, intermediate=1, layers=0, heads=1, kv_heads=1)  # 1e9 + 1
    w = Workload(micro_batch=1, seq_len=1000, grad_accum=1, checkpointing=False)
    mc = Machine(gpus_per_node=1, device_flops=1e15, mfu=0.5, pcie_Bps=10e9, nvme_read_Bps=2e9,
                 nvme_write_Bps=1e9, adam_params_per_s=1e9, interconnect_Bps=1e9)
    p = predict(m, w, Placement("nvme", "nvme"), mc)
    n = m.params
    fwd_c = 2 * n * 1000 / 5e14  # 4 ms
    assert p["resources"]["compute"] == pytest.approx(3 * fwd_c)
    assert p["resources"]["pcie"] == pytest.approx((2 * n + 2 * n + 4 * n) / 10e9)
    assert p["resources"]["nvme read"] == pytest.approx((2 * n + 2 * n + 16 * n) / 2e9)  # params x2, opt + grad
    assert p["resources"]["nvme write"] == pytest.approx((4 * n + 12 * n + 2 * n) / 1e9)
    assert p["resources"]["cpu adam"] == pytest.approx(n / 1e9)
    assert p["resources"]["collectives"] == 0
    fwd = max(fwd_c, 2 * n / 10e9, 2 * n / 2e9)
    bwd = max(2 * fwd_c, 6 * n / 10e9, 2 * n / 2e9 + 4 * n / 1e9)
    upd = max(16 * n / 2e9 + 12 * n / 1e9 + 2 * n / 1e9, n / 1e9)
    assert p["step_s"] == pytest.approx(bwd + max(fwd_c, 2 * n / 10e9, 2 * n / 2e9 + upd))  # the drive is shared
    assert fwd < upd
    assert p["bottleneck"] == "nvme write"


def test_step_model_with_the_update_in_the_backward():
    """Config.update_in_backward: the update's nvme traffic and Adam share the backward's phase instead of
    following it; the same machine and model as above, by hand."""
    m = ModelSpec("x", vocab=500_000_000, hidden=1, intermediate=1, layers=0, heads=1, kv_heads=1)
    mc = Machine(gpus_per_node=1, device_flops=1e15, mfu=0.5, pcie_Bps=10e9, nvme_read_Bps=2e9,
                 nvme_write_Bps=1e9, adam_params_per_s=1e9, interconnect_Bps=1e9)
    w = Workload(micro_batch=1, seq_len=1000, grad_accum=1, checkpointing=False)
    exact = predict(m, w, Placement("nvme", "nvme"), mc)
    early = predict(m, Workload(micro_batch=1, seq_len=1000, grad_accum=1, checkpointing=False,
                                update_in_backward=True), Placement("nvme", "nvme"), mc)
    n = m.params
    # disk-bound: forward reads, backward reads and writes and the update's, one after the other on one drive
    nvme = 2 * n / 2e9 + (2 * n / 2e9 + 4 * n / 1e9) + (16 * n / 2e9 + 14 * n / 1e9)
    assert early["step_s"] == pytest.approx(nvme) == exact["step_s"]  # the drive binds: nothing to gain
    assert early["resources"] == exact["resources"]  # the same bytes, overlapped differently
    fast = Machine(gpus_per_node=1, device_flops=1e15, mfu=0.5, pcie_Bps=10e9, nvme_read_Bps=200e9,
                   nvme_write_Bps=100e9, adam_params_per_s=1e11, interconnect_Bps=1e9)
    w_early = Workload(micro_batch=1, seq_len=1000, grad_accum=1, checkpointing=False, update_in_backward=True)
    e, x = predict(m, w_early, Placement("nvme", "nvme"), fast), predict(m, w, Placement("nvme", "nvme"), fast)
    c = 3 * 2 * n * 1000 / 5e14  # compute binds once the drives are fast: the update hides under it
    assert e["step_s"] == pytest.approx(max(c, 8 * n / 10e9)) and e["step_s"] < x["step_s"]


def test_plan_70b_on_one_node(tmp_path, capsys):
    rc = main(["plan", "--model", "llama-70b", "--gpus", "8", "--gpu-mem", "80GiB", "--cpu-mem", "1TiB",
               "--nvme-read", "25GB/s", "--nvme-write", "12GB/s", "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "fits: placement params=device, optimizer=nvme" in out  # 1.1 TB of optimizer state: not in 1 TiB RAM
    # 1 TiB of RAM keeps most of the optimizer states resident (the runtime's residency plan): the fused CPU
    # AdamW over 69B parameters binds, not the drive
    assert "predicted step" in out and "bottleneck: cpu adam" in out and "tokens/s" in out
    for resource in ("compute", "pcie", "nvme read", "nvme write", "cpu adam", "collectives"):
        assert resource in out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["chosen"]["prediction"]["step_s"] > 0 and plan["advice"]
    # the gradient shards (32 GiB a rank) fit beside the params, activations and gathered units: kept on the
    # device, as the runtime does, so the disk writes only master and moments (12 bytes a parameter)
    assert "grads=device" in out
    n = PRESETS["llama-70b"].params

    def written(option) -> float:  # master + moments (and gradients when on nvme) beyond the host's room
        room = 0.8 * (1 << 40) / 8 - sum(option["tiers"]["cpu"].values())
        states = {k: v for k, v in option["tiers"]["nvme"].items() if k != "spares"}  # (spare slots: no traffic)
        return 8 * max(0.0, sum(states.values()) - room) / 12e9

    assert plan["chosen"]["prediction"]["resources"]["nvme write"] == pytest.approx(written(plan["chosen"]))
    # the lanes' staging is a few chunks a rank (0.4 GiB, not the 8 GiB of four units' states once counted), so
    # the 103 GB of master and moments a rank stay resident in its 110 GB of host memory: nothing pages
    assert 0 <= written(plan["chosen"]) < 12 * n / 12e9 / 10
    paged = next(o for o in plan["options"] if o["placement"] == "params=device, optimizer=nvme")
    assert paged["prediction"]["resources"]["nvme write"] == pytest.approx(written(paged))


def test_plan_update_in_backward(tmp_path, capsys):
    args = ["plan", "--model", "llama-70b", "--gpus", "8", "--gpu-mem", "80GiB", "--cpu-mem", "1TiB",
            "--nvme-read", "25GB/s", "--nvme-write", "12GB/s"]
    for accum in ("1", "4"):  # (accumulation under rt.accumulating(): one gradient shard per unit, as by default)
        steps = []
        for extra in ([], ["--update-in-backward"]):
            assert main(args + extra + ["--grad-accum", accum, "--json", str(tmp_path / "p.json")]) == 0
            steps.append(json.loads((tmp_path / "p.json").read_text())["chosen"]["prediction"]["step_s"])
        assert steps[1] < steps[0], accum
    assert "predicted step" in capsys.readouterr().out


def test_plan_speculative_updates(tmp_path, capsys):
    """Speculative updates (Config.speculative_updates, the default): their spare slots count on nvme, the
    optimizer states' size again (none with --no-speculative-updates); at steps that do not clip (--unclipped)
    the step is predicted as with the update in the backward, which is what they do there, exactly."""
    args = ["plan", "--model", "llama-70b", "--gpus", "8", "--gpu-mem", "80GiB", "--cpu-mem", "1TiB",
            "--nvme-read", "25GB/s", "--nvme-write", "12GB/s", "--json", str(tmp_path / "p.json")]

    def chosen(*extra):
        assert main(args + list(extra)) == 0
        return json.loads((tmp_path / "p.json").read_text())["chosen"]

    default, without = chosen(), chosen("--no-speculative-updates")
    nvme = default["tiers"]["nvme"]
    assert nvme["spares"] == nvme["master"] + nvme["moments"] and "spares" not in without["tiers"]["nvme"]
    unclipped, in_backward = chosen("--unclipped"), chosen("--update-in-backward")
    assert unclipped["prediction"]["step_s"] == in_backward["prediction"]["step_s"] < default["prediction"]["step_s"]
    assert chosen("--unclipped", "--no-speculative-updates")["prediction"]["step_s"] == default["prediction"]["step_s"]
    capsys.readouterr()


def test_plan_says_what_is_short(capsys):
    rc = main(["plan", "--model", "llama-70b", "--gpus", "1", "--gpu-mem", "24GiB", "--cpu-mem", "64GiB",
               "--nvme-size", "1TiB"])  # (the states and the spare slots speculative updates write into)
    out = capsys.readouterr().out
    assert rc == 0
    assert "does NOT fit" in out and re.search(r"short on .*nvme by [0-9.]+ GiB", out)


def test_model_from_a_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096}))
    assert model_from(str(tmp_path)).params == PRESETS["llama-7b"].params
    # an explicit head_dim (Qwen3, Gemma) sets the q/k/v/o widths instead of hidden / heads
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "head_dim": 256, "num_attention_heads": 8,
                                                      "num_key_value_heads": 2}))
    m = model_from(str(tmp_path))
    h = 4096
    assert m.layer_params == h * 2048 + 2 * h * 512 + 2048 * h + 3 * h * 11008 + 2 * h
    with pytest.raises(ValueError, match="neither a preset"):
        model_from(str(tmp_path / "missing.json"))



@pytest.mark.parametrize("flag, value, says", [
    ("--gpus", "0", "below 1"), ("--gpus", "-2", "below 1"), ("--nodes", "0", "below 1"),
    ("--micro-batch", "0", "below 1"), ("--seq-len", "0", "below 1"), ("--grad-accum", "0", "below 1"),
    ("--mfu", "2", "at most 1"), ("--mfu", "0", "above 0"), ("--tflops", "-5", "above 0"),
    ("--gpu-mem", "80", "80: add a unit, e.g. 80GiB"), ("--cpu-mem", "1024", "1024: add a unit"),
    ("--nvme-size", "lots", "nvme-size"),
])
def test_plan_refuses_nonsense_numbers_naming_the_flag(flag, value, says, capsys):
    """Each was accepted (or a ZeroDivisionError): "-2 ranks", "-16880 tokens/s", 80 bytes of GPU memory."""
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--model", "llama-7b", flag, value])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert f"argument {flag}" in err and says in err, err


def test_the_plan_names_the_config_that_makes_the_runtime_take_its_placement(capsys):
    """The plan counts on 80% of host memory where the runtime's "auto" cpu budget is half of what is available
    (a 70B on 1.5 TiB: the plan's params=device, optimizer=cpu needs 129 GiB a rank, "auto" gives at most 96), and
    puts gradients on the device where "auto" does so only under a given device budget: the run took another
    placement, or refused. The plan now names the fields that make the runtime take its choice (fields Config
    accepts)."""
    import offload

    assert main(["plan", "--model", "llama-70b", "--gpus", "8", "--gpu-mem", "80GiB", "--cpu-mem", "1.5TiB"]) == 0
    out = capsys.readouterr().out
    assert "fits: placement params=device, optimizer=cpu" in out
    assert "run it with: offload.Config(params='device', optimizer='cpu', cpu_budget='135GiB')" in out, out
    assert main(["plan", "--model", "llama-7b", "--gpus", "3", "--gpu-mem", "24GiB", "--cpu-mem", "64GiB"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("run it with"))
    assert line == "run it with: offload.Config(params='device', optimizer='nvme', grads='device')"
    offload.Config(params="device", optimizer="nvme", grads="device", nvme_path="/tmp")  # fields the Config takes


@pytest.mark.parametrize("flag", ["--nvme-read", "--pcie"])
def test_plan_refuses_a_zero_rate_naming_the_flag(flag, capsys):
    """A rate of 0 ended in a ZeroDivisionError traceback."""
    assert main(["plan", "--model", "llama-7b", flag, "0GB/s"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} '0GB/s': a rate must be above zero" in err and "Traceback" not in err, err


def test_plan_counts_and_advice_read_right(capsys):
    """"1 ranks"; and with NVMe unbounded, "a larger NVMe drive" was advised where only host RAM was short."""
    # (16 GiB of host RAM once lacked a 7B model's staging, when it was counted as four units' states; the lanes
    # hold a few chunks: 512 MiB lacks the 8 MiB chunks of a decoder layer's params gathered from nvme, 0.8 GiB)
    assert main(["plan", "--model", "llama-7b", "--gpus", "1", "--gpu-mem", "8GiB", "--cpu-mem", "512MiB"]) == 0
    out = capsys.readouterr().out
    assert "; 1 rank (1 node x 1)" in out, out
    assert "does NOT fit" in out and "short on cpu" in out and "short on device" not in out, out
    assert "larger NVMe drive" not in out and "more host RAM (--cpu-mem)" in out, out


def test_resident_host_memory_saves_the_most_traffic_per_byte_first():
    """What the host keeps of the nvme-homed states moves no nvme bytes, in the runtime's residency order: the
    parameters (read twice a micro-batch, written once a step), the gradients, then master and moments."""
    from offload.plan.step_time import movement, paged_bytes

    n = 1e9  # parameters per rank: params 2 GB, grads 4 GB, optimizer 12 GB
    place = Placement("nvme", "nvme")
    assert paged_bytes(n, place, 0) == {"params": 2e9, "grads": 4e9, "optimizer": 12e9}
    assert paged_bytes(n, place, 3e9) == {"params": 0.0, "grads": 3e9, "optimizer": 12e9}
    assert paged_bytes(n, place, 10e9) == {"params": 0.0, "grads": 0.0, "optimizer": 8e9}
    assert paged_bytes(n, place, 1e12) == {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    assert paged_bytes(n, Placement("cpu", "nvme", "device"), 1e9)["optimizer"] == 11e9  # only nvme homes take room
    mc = Machine(gpus_per_node=1, nvme_read_Bps=1e9, nvme_write_Bps=1e9)
    none, some = movement(n, place, mc), movement(n, place, mc, resident_bytes=3e9)
    assert none.nvme_fwd == 2.0 and some.nvme_fwd == 0.0  # the params no longer read
    assert (none.nvme_upd_write, some.nvme_upd_write) == (14.0, 12.0)  # optimizer + params written
    assert (none.nvme_bwd_write, some.nvme_bwd_write) == (4.0, 3.0)


def test_offloaded_activations_leave_the_device_but_a_window():
    """Config.activations: with checkpointing every layer's input but ACTIVATION_WINDOW (3) of them waits in the
    chosen tier; without it every layer's activations but 3; the logits stay."""
    m = ModelSpec("t", vocab=1000, hidden=64, intermediate=256, layers=10, heads=4, kv_heads=4)
    sbh = 128 * 2 * 64
    for ckpt, per_layer in ((True, 2 * sbh), (False, 34 * sbh)):
        none = Workload(micro_batch=2, seq_len=128, checkpointing=ckpt)
        for home in ("cpu", "nvme"):
            w = Workload(micro_batch=2, seq_len=128, checkpointing=ckpt, activations=home)
            assert activation_bytes(m, none) - activation_bytes(m, w) == 7 * per_layer
            t = tier_bytes(m, w, 8, Placement("cpu", "cpu"))
            assert t[home]["activations"] == 7 * per_layer and t["device"]["activations"] == activation_bytes(m, w)
    assert "activations" not in tier_bytes(m, none, 8, Placement("cpu", "cpu"))["cpu"]


def test_the_plans_activation_window_is_the_runtimes():
    """What `offload plan` leaves on the device of offloaded activations is what the offloader may hold by design:
    the tensor in use and READ_AHEAD brought back early in the backward, OUT_WINDOW waiting to leave in the
    forward (tests/test_activation_offload.py measures the runtime against the same window)."""
    from offload.plan.memory import ACTIVATION_WINDOW
    from offload.zero.activations import OUT_WINDOW, READ_AHEAD

    assert ACTIVATION_WINDOW == READ_AHEAD + 1 == OUT_WINDOW + 1


def test_offloaded_activations_cost_their_transfers():
    """One rank, params and optimizer on the device: the only transfers are the activations', out over pcie in the
    forward and back in the backward, and to nvme written in the forward and read in the backward."""
    m = ModelSpec("t", vocab=32_000, hidden=4096, intermediate=11_008, layers=32, heads=32, kv_heads=32)
    mc = Machine(gpus_per_node=1, pcie_Bps=10e9, nvme_read_Bps=2e9, nvme_write_Bps=1e9)
    w = Workload(micro_batch=1, seq_len=8192, checkpointing=True)
    moved = 2 * 8192 * 4096 * 29  # 29 layers' inputs, bf16
    base = predict(m, w, Placement("device", "device"), mc)
    cpu = predict(m, Workload(micro_batch=1, seq_len=8192, activations="cpu"), Placement("device", "device"), mc)
    nvme = predict(m, Workload(micro_batch=1, seq_len=8192, activations="nvme"), Placement("device", "device"), mc)
    assert base["resources"]["pcie"] == 0 and base["resources"]["nvme write"] == 0
    assert cpu["resources"]["pcie"] == pytest.approx(2 * moved / 10e9)
    assert nvme["resources"]["nvme write"] == pytest.approx(moved / 1e9)
    assert nvme["resources"]["nvme read"] == pytest.approx(moved / 2e9)
    assert base["step_s"] <= cpu["step_s"] <= nvme["step_s"]


def test_plan_with_activations_offloaded_fits_a_longer_sequence(capsys):
    """The 70B at 112K tokens: short on GPU memory with the activations there (the advice names the flag); with
    --activations nvme it fits and the table shows them on nvme."""
    args = ["plan", "--model", "llama-70b", "--gpus", "8", "--gpu-mem", "80GiB", "--cpu-mem", "1TiB",
            "--seq-len", "114688"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "--activations cpu, or nvme" in out
    assert main(args + ["--activations", "nvme"]) == 0
    out = capsys.readouterr().out
    assert "fits: placement" in out and "activations offloaded to nvme" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("activations"))
    assert row.split()[-2:] == ["134.75", "GiB"]  # 77 layers' inputs x 112K x 8192 x 2 bytes


def test_the_longest_sequence_that_fits_and_with_activations_offloaded(capsys):
    """offload plan says how long a sequence the placement holds: the longest multiple of 1024 tokens that fits
    (one more step does not), longer with the activations offloaded (the 70B on one 8x80 GiB node: on the device
    about 38K tokens, to the cpu 65K, to nvme 135K, where the logits and one layer's recompute are what stay)."""
    from offload.plan.sizing import SEQ_STEP, capacity, longest_sequences, resolve_activations, shortfall, tiers_for

    m, mc = PRESETS["llama-70b"], Machine(gpus_per_node=8)
    cap = capacity(80 << 30, 1 << 40, None)
    w = Workload(micro_batch=1, seq_len=4096)
    place = Placement("cpu", "nvme")  # what the command picks as the closest at 128K (below)
    longest = longest_sequences(m, w, mc, cap, place)
    assert 32 * 1024 < longest["none"] < longest["cpu"] < longest["nvme"] < 256 * 1024, longest
    assert longest["auto"] == max(longest["cpu"], longest["nvme"])  # (auto: cpu where it fits, else nvme)
    for where, n in longest.items():
        if where == "auto":
            continue

        def fits(seq):  # as the runtime runs it (a longer sequence may leave no room to gather a unit ahead)
            wider = resolve_activations(m, Workload(micro_batch=1, seq_len=seq, activations=where), mc, cap, place)
            return not shortfall(tiers_for(m, wider, mc, cap, place), cap, 8)
        assert n % SEQ_STEP == 0 and fits(n) and not fits(n + SEQ_STEP), (where, n)
    assert main(["plan", "--model", "llama-70b", "--gpus", "8", "--gpu-mem", "80GiB", "--cpu-mem", "1TiB",
                 "--seq-len", "131072"]) == 0
    out = capsys.readouterr().out
    assert (f"longest sequence that fits params=cpu, optimizer=nvme (micro-batch and the rest as above): "
            f"{longest['none']} tokens with the activations on the device, {longest['cpu']} offloaded to cpu, "
            f"{longest['nvme']} to nvme, {longest['auto']} with auto") in out


def test_plan_knows_the_optimizer_family(tmp_path, capsys):
    """Bytes per parameter and the 70B step for fp32, bf16 and 8-bit states (and Lion's one moment)."""
    from offload.plan.memory import state_bytes
    from offload.plan.step_time import update_rate

    totals = {f: state_bytes(Workload(optimizer_states=f)).total for f in ("adamw", "adamw-bf16", "adamw8bit", "lion")}
    assert totals == {"adamw": 18, "adamw-bf16": 14, "adamw8bit": 10 + 2 + 2 * 4 / 256, "lion": 14}
    eight = state_bytes(Workload(optimizer_states="adamw8bit"))
    # 8-bit AdamW moves 16 bytes a parameter where the fp32 kernel moves 28; its block search bounds it where cores
    # are few: a 2-core host steps 2 x 2.6e8 parameters a second, a 96-core node the memory-bound 28/16 of AdamW's
    assert update_rate(Machine(host_cores=2, adam_params_per_s=2.3e9), eight) == pytest.approx(2 * 2.6e8)
    assert update_rate(Machine(), eight) == pytest.approx(2e9 * 28 / 16.06)
    plans = {}
    for family in ("adamw", "adamw-bf16", "adamw8bit"):
        rc = main(["plan", "--model", "llama3-70b", "--cpu-mem", "512GiB", "--nvme-read", "25GB/s",
                   "--nvme-write", "12GB/s", "--optimizer-states", family, "--json", str(tmp_path / f"{family}.json")])
        assert rc == 0
        assert f"{family} states" in capsys.readouterr().out
        plans[family] = json.loads((tmp_path / f"{family}.json").read_text())["chosen"]
    per_rank = {f: sum(p["tiers"]["nvme"].values()) for f, p in plans.items()}
    assert per_rank["adamw8bit"] < per_rank["adamw-bf16"] < per_rank["adamw"]
    step = {f: p["prediction"]["step_s"] for f, p in plans.items()}
    assert step["adamw8bit"] < step["adamw-bf16"] < step["adamw"]  # fewer bytes on a drive-bound node


def test_plan_activations_auto_takes_the_host_then_the_drive(tmp_path, capsys):
    """--activations auto, as Config.activations="auto" runs: in host memory where they fit beside the states,
    else on nvme; its longest sequence is the better of the two."""
    def plan(seq, cpu_mem):  # one 8xH100 node
        rc = main(["plan", "--model", "llama3-70b", "--cpu-mem", cpu_mem, "--nvme-read", "25GB/s", "--nvme-write",
                   "12GB/s", "--seq-len", str(seq), "--activations", "auto", "--json", str(tmp_path / "a.json")])
        assert rc == 0
        capsys.readouterr()
        return json.loads((tmp_path / "a.json").read_text())

    roomy = plan(8192, "2TiB")
    assert roomy["chosen"]["activations"] == "cpu"
    tight = plan(8192, "1320GiB")  # the host holds the optimizer states on cpu, not the activations beside them
    by_place = {str(o["placement"]): o for o in tight["options"]}
    assert by_place["params=device, optimizer=cpu"]["activations"] == "nvme"
    assert not by_place["params=device, optimizer=cpu"]["short"]
    longest = roomy["longest_seq"]["tokens"]
    assert longest["auto"] == max(longest["cpu"], longest["nvme"])


# -- the count: every parameter, experts included (issue 45) ------------------------------------------------------

# Mixtral-8x7B's config.json as published (mistralai/Mixtral-8x7B-v0.1)
MIXTRAL_8X7B_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000}

_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=320, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# small configs of each family the installed transformers has: biases, q/k norms, MoE layers among dense ones,
# shared experts, latent attention, tied and untied heads
_FAMILIES = [
    ("LlamaConfig", _SMALL),
    ("LlamaConfig", dict(_SMALL, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    ("Qwen2Config", _SMALL),
    ("MistralConfig", dict(_SMALL, head_dim=32)),
    ("Phi3Config", _SMALL),
    ("Qwen3Config", dict(_SMALL, head_dim=24)),
    ("GPT2Config", dict(n_embd=64, n_layer=3, n_head=4, vocab_size=320, n_positions=128, bos_token_id=1,
                        eos_token_id=2)),
    ("MixtralConfig", dict(_SMALL, num_local_experts=4, num_experts_per_tok=2)),
    ("Qwen2MoeConfig", dict(_SMALL, **_MOE, num_experts=4, shared_expert_intermediate_size=48,
                            decoder_sparse_step=2, mlp_only_layers=[3])),
    ("Qwen3MoeConfig", dict(_SMALL, **_MOE, num_experts=4, head_dim=24, mlp_only_layers=[0])),
    ("DeepseekV3Config", dict(_SMALL, **_MOE, n_routed_experts=4, n_shared_experts=2, first_k_dense_replace=1,
                              q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              n_group=1, topk_group=1)),
    ("DeepseekV3Config", dict(_SMALL, **_MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=2,
                              q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                              v_head_dim=16, n_group=1, topk_group=1, attention_bias=True)),
    ("GptOssConfig", dict(_SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=16)),
]


def _meta_count(config) -> int:
    """The model's own count: built on the meta device (no memory), as transformers builds it."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).num_parameters()


def _saved_config(config, tmp_path):
    """The config.json save_pretrained writes (only what differs from the defaults, as on the Hub)."""
    config.save_pretrained(tmp_path)
    return model_from(str(tmp_path))


@pytest.mark.parametrize("family, kwargs", _FAMILIES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(_FAMILIES)])
def test_the_count_is_the_models_own(family, kwargs, tmp_path):
    """offload plan counted the Llama shape: no experts (a tiny Mixtral was "0.00B", Mixtral-8x7B 7.24B), no
    biases, no shared experts, no dense layers among MoE ones. Each family's config.json, as save_pretrained writes
    it, now counts what the model's own num_parameters() says."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, family):
        pytest.skip(f"this transformers has no {family}")
    config = getattr(transformers, family)(**kwargs)
    m = _saved_config(config, tmp_path)
    assert m.params == _meta_count(config)
    if m.experts:  # a token runs through num_experts_per_tok routed experts
        assert m.active_params == m.params - m.moe_layers * (m.experts - m.experts_per_token) * m.expert_params
        assert 0 < m.active_params < m.params


def test_every_preset_counts_as_the_model_built_from_it():
    transformers = pytest.importorskip("transformers")
    from offload.plan.model_spec import MIXTRAL_8X7B

    for name, m in PRESETS.items():
        if m.experts:
            config = transformers.MixtralConfig(**{k: v for k, v in MIXTRAL_8X7B.items() if k != "model_type"})
        else:
            config = transformers.LlamaConfig(vocab_size=m.vocab, hidden_size=m.hidden,
                                              intermediate_size=m.intermediate, num_hidden_layers=m.layers,
                                              num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                                              tie_word_embeddings=m.tied)
        assert m.params == _meta_count(config), name


def test_mixtral_8x7b_is_46_7b_and_does_not_fit_where_it_cannot(tmp_path, capsys):
    """The published config.json: 46.7B parameters (12.9B active), not 7.24B. On 8x 80 GiB with 256 GiB of host RAM
    and 100 GiB of NVMe its 783 GiB of states hold nowhere (at 7.24B the plan said it fit on the devices alone); with
    the drive unbounded the states go to nvme, never all on the device."""
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B_CONFIG))
    m = model_from(str(tmp_path))
    assert m.params == pytest.approx(46.7e9, abs=0.1e9) and m.active_params == pytest.approx(12.9e9, abs=0.1e9)
    assert m.params == PRESETS["mixtral-8x7b"].params
    base = ["plan", "--model", str(tmp_path), "--gpus", "8", "--gpu-mem", "80GiB", "--cpu-mem", "256GiB"]
    assert main(base + ["--nvme-size", "100GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path.name}: 46.70B parameters, 12.88B active per token (2 of 8 experts in 32 of 32 "
                          "layers)"), out
    assert "does NOT fit" in out and "fits: placement" not in out, out
    assert main(base + ["--json", str(tmp_path / "p.json")]) == 0
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["model"]["params"] == m.params and plan["model"]["active_params"] == m.active_params
    device_only = next(o for o in plan["options"] if o["placement"] == "params=device, optimizer=device")
    assert device_only["short"]["device"] > 0  # 98 GiB of states a rank, 72 GiB usable
    assert "optimizer=nvme" in plan["chosen"]["placement"]
    assert sum(plan["chosen"]["tiers"]["device"].values()) <= 0.9 * 80 * 2**30
    capsys.readouterr()


def test_the_compute_counts_the_active_parameters():
    """A forward is 2 x the active parameters' FLOPs per token: Mixtral runs 2 of its 8 experts."""
    m = PRESETS["mixtral-8x7b"]
    mc = Machine(gpus_per_node=1)
    w = Workload(micro_batch=1, seq_len=1024, checkpointing=False)
    p = predict(m, w, Placement("device", "device"), mc)
    fwd = (2 * m.active_params + 4 * m.layers * m.hidden * 1024) * 1024
    assert p["resources"]["compute"] == pytest.approx(3 * fwd / (mc.device_flops * mc.mfu))


def test_a_tiny_moe_says_its_count(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(**dict(_SMALL, num_local_experts=4, num_experts_per_tok=2))
    config.save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--gpus", "1", "--gpu-mem", "8GiB", "--cpu-mem", "16GiB"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f": {_meta_count(config):,} parameters, " in first and "0.00B" not in first, first

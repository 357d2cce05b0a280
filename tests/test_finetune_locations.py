"""`offload finetune` on the first day: every location and budget checked before the model loads, by the
runtime's own rules; a run's directories its own while it lives (a second run refused with its pid); what a
killed run leaves found and removed by the next; every error one line naming the flag.

The runs are real (a 2-layer Llama saved by transformers, test_finetune's fixtures); the only stand-in is
the free space a drive reports (shutil.disk_usage), to put the drive's edge where the test needs it."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_finetune import _fails, text_file, tiny_model  # noqa: E402,F401 - fixtures shared with the main tests

from offload.cli import build_parser, main  # noqa: E402
from offload.finetune import FinetuneConfig, finetune  # noqa: E402
from offload.finetune.job import runtime_config
from offload.finetune.preflight import as_flags, swap_bytes_per_rank  # noqa: E402


def _small_data(tmp_path, text_file) -> Path:
    data = tmp_path / "small.txt"
    data.write_text(text_file.read_text()[:40_000])  # a quick start
    return data


def _start(tmp_path, tiny_model, data, *extra, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "offload.cli", "finetune", "--model", str(tiny_model), "--data", str(data),
           "--steps", "400", "--seq-len", "64", "--eval-blocks", "2", "--compute-dtype", "fp32",
           "--cpu-budget", "8MiB", "--checkpoint-every", "1", "--keep-checkpoints", "1",
           "--output", str(tmp_path / "out"), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def _wait_for_a_step(proc, checkpoints: Path) -> None:
    deadline = time.monotonic() + 240
    while not (checkpoints / "latest").exists():  # a step done and checkpointed
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)


# ---- a run's directories are its own --------------------------------------------------------------
def test_a_second_run_on_a_live_runs_output_is_refused_with_its_pid(tmp_path, tiny_model, text_file, capsys):
    """Two runs with one --output both exited 0: one's pruning deleted the other's checkpoints, and the
    model was whichever finished last."""
    data = _small_data(tmp_path, text_file)
    first = _start(tmp_path, tiny_model, data)
    try:
        _wait_for_a_step(first, tmp_path / "out" / "checkpoints")
        err = _fails(capsys, ["--model", str(tiny_model), "--data", str(data), "--output", str(tmp_path / "out"),
                              "--steps", "2"], f"--output {tmp_path / 'out'}: in use by another live run",
                     f"pid {first.pid}", "give another --output")
        assert len(err.strip().splitlines()) == 1
        # a separate --checkpoint-dir is held too
        ckpts = tmp_path / "ckpts"
        second = _start(tmp_path / "second", tiny_model, data, "--checkpoint-dir", str(ckpts))
        try:
            _wait_for_a_step(second, ckpts)
            _fails(capsys, ["--output", str(tmp_path / "third"), "--checkpoint-dir", str(ckpts), "--steps", "2"],
                   f"--checkpoint-dir {ckpts}: in use by another live run", f"pid {second.pid}")
        finally:
            second.kill()
            second.wait()
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    finally:
        first.kill()  # a no-op once it has exited
        first.wait()
    assert first.returncode == 128 + signal.SIGTERM
    assert not (tmp_path / "out" / ".offload-lock").exists()  # released on the way out
    assert not (tmp_path / "third").exists()  # the refused run left nothing behind


def test_a_killed_runs_swap_is_removed_by_the_next_run(tmp_path, tiny_model, text_file, capsys, monkeypatch, caplog):
    """kill -9 (the OOM killer, a node failure) left the default swap directory, model-sized, in the temp
    directory for good. The next run finds it unlocked and removes it before it measures free space; the
    killed run's --output is not held against it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    data = _small_data(tmp_path, text_file)
    run = _start(tmp_path, tiny_model, data, env={"TMPDIR": str(tmp)})  # default swap: TMPDIR/offload-finetune-*
    try:
        _wait_for_a_step(run, tmp_path / "out" / "checkpoints")
        left = list(tmp.glob("offload-finetune-*/offload-*/*.swap"))
        assert left
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    assert all(p.exists() for p in left)  # nothing could clean up
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    # the next run, stopped by a setting checked after the clean-up but before the model loads
    _fails(capsys, ["--model", str(tiny_model), "--data", str(data), "--output", str(tmp_path / "out"),
                    "--cpu-budget", "100TiB"], "--cpu-budget")
    assert list(tmp.glob("*offload-*")) == []  # the dead run's, and the refused run's own
    assert f"pid {run.pid}" in caplog.text and "left by a run that died" in caplog.text


# ---- the swap space: one rule for the check and the store ----------------------------------------
def test_the_swap_check_and_the_store_agree(tmp_path, tiny_model, text_file, monkeypatch, capsys):
    """The check before loading wanted the states' bytes of free space, the store then took 90% of the free
    space as its budget: on a drive between the two every step ran up to the first opt.step(), which died of a
    SwapSpaceError naming a setting the command has no flag for. Now both take the store's budget, the check
    counts what the store will hold (a bound, tested here against the store's own count), and --nvme-budget
    sets it."""
    swap = tmp_path / "swap"
    swap.mkdir()
    common = dict(model=str(tiny_model), data=str(text_file), steps=1, seq_len=64, compute_dtype="bf16",
                  cpu_budget="8MiB", eval_blocks=4, nvme_path=str(swap), output=str(tmp_path / "out"))
    rcfg = runtime_config(FinetuneConfig(**common), str(swap))
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    bound = swap_bytes_per_rank(rcfg, sum(p.numel() for p in shapes.parameters()), len(list(shapes.parameters())), 1)
    used = {}
    finetune(FinetuneConfig(**common), on_trained=lambda rt, m: used.update(rt.states.stats()["nvme"]))
    assert used["bytes_in_use"] <= bound <= 1.15 * used["bytes_in_use"] + (1 << 20)

    real = shutil.disk_usage
    for free, fits in ((int(bound / 0.9) + 4096, True), (int(bound / 0.95), False)):  # 90% of it: above, below
        monkeypatch.setattr(shutil, "disk_usage", lambda p, free=free: real(p)._replace(free=free))
        args = ["--model", str(tiny_model), "--data", str(text_file), "--steps", "1", "--seq-len", "64",
                "--compute-dtype", "bf16",  # the bound above is bf16's ("auto" computes in fp32 without bf16)
                "--cpu-budget", "8MiB", "--eval-blocks", "4", "--nvme-path", str(swap), "--output",
                str(tmp_path / f"out-{fits}")]
        if fits:
            assert main(["finetune", *args]) == 0, capsys.readouterr().err  # and no SwapSpaceError in its step
        else:
            _fails(capsys, args, f"--nvme-path {swap}: this run swaps up to", "90% of the",
                   "give --nvme-path on a larger drive")
            assert not (tmp_path / f"out-{fits}").exists()  # refused before the model loaded
    monkeypatch.setattr(shutil, "disk_usage", real)
    _fails(capsys, [*args[:-2], "--nvme-budget", "1MiB", "--output", str(tmp_path / "o")], "--nvme-budget 1MiB")
    assert list(swap.iterdir()) == []


def test_a_lora_runs_swap_check_counts_states_of_the_adapters_only(tmp_path, tiny_model, text_file):
    """With --lora-r the frozen base has no gradient and no optimizer states: the check counted them for every
    parameter (a 7B base with --lora-r 16 asked for about 126 GB of swap where about 14 GB is used) and refused
    runs that fit. Its bound now holds the store's own count closely, as for a full fine-tune."""
    from offload.finetune.job import _with_lora

    swap = tmp_path / "swap"
    swap.mkdir()
    common = dict(model=str(tiny_model), data=str(text_file), steps=1, seq_len=64, compute_dtype="bf16",
                  cpu_budget="8MiB", eval_blocks=4, nvme_path=str(swap), output=str(tmp_path / "out"), lora_r=4)
    rcfg = runtime_config(FinetuneConfig(**common), str(swap))
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        shapes = _with_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model)),
                            FinetuneConfig(**common))
    params = list(shapes.parameters())
    bound = swap_bytes_per_rank(rcfg, sum(p.numel() for p in params), len(params), 1,
                                sum(p.numel() for p in params if p.requires_grad))
    used = {}
    finetune(FinetuneConfig(**common), on_trained=lambda rt, m: used.update(rt.states.stats()["nvme"]))
    assert used["bytes_in_use"] <= bound <= 1.15 * used["bytes_in_use"] + (1 << 20), (used, bound)


# ---- one line, naming the flag ------------------------------------------------------------------
def test_runtime_refusals_name_the_flags(tmp_path, tiny_model, text_file, capsys):
    """--cpu-budget 1MiB raised a MemoryError naming offload.Config.cpu_budget and advising params and
    optimizer "nvme" when both were; budgets above the machine died inside torch's allocator."""
    base = ["--model", str(tiny_model), "--data", str(text_file), "--seq-len", "64", "--steps", "1",
            "--compute-dtype", "bf16", "--output", str(tmp_path / "out")]  # (1MiB holds fp32's states: "auto" may be)
    err = _fails(capsys, [*base, "--cpu-budget", "1MiB"], "--cpu-budget: with --params nvme and --optimizer nvme",
                 "raise --cpu-budget")
    assert "offload.Config" not in err and "set --params" not in err and "Traceback" not in err
    err = _fails(capsys, [*base, "--cpu-budget", "64KiB", "--params", "cpu"], "set --params nvme")
    assert "set --optimizer" not in err
    err = _fails(capsys, [*base, "--cpu-budget", "100TiB"], "--cpu-budget: 100.00 TiB is more host memory than")
    if not torch.cuda.is_available():
        from offload.store import host_memory

        half = f"{(host_memory()[0] // 2 >> 20) + 512}MiB"  # each fits; the two together do not
        _fails(capsys, [*base, "--cpu-budget", half, "--device-budget", half], "--device-budget + --cpu-budget",
               "device tier is a region of host memory")
    assert not (tmp_path / "out").exists()


def test_as_flags_spells_settings_as_the_command_does():
    assert as_flags("offload.Config.nvme_path: x; raise nvme_budget or cpu_budget, set params='nvme'") == \
        "--nvme-path: x; raise --nvme-budget or --cpu-budget, set --params nvme"
    assert as_flags("lower offload.Config.chunk_size") == "lower chunk_size (in --config)"
    assert as_flags("--cpu-budget stays") == "--cpu-budget stays"


def test_a_micro_batch_too_large_for_memory_is_one_line(tmp_path, tiny_model, text_file):
    """A raw allocator error (a traceback) before. The process's address space is capped a few GiB above what
    it holds after start-up, so the first activation of a 400k-sequence micro-batch cannot be had, as on a
    machine that small, without endangering this one."""
    code = textwrap.dedent(f"""
        import resource, sys
        import offload.cli, torch, transformers
        vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 30), resource.RLIM_INFINITY))
        sys.exit(offload.cli.main(["finetune", "--model", {str(tiny_model)!r}, "--data", {str(text_file)!r},
                                   "--seq-len", "64", "--steps", "1", "--eval-blocks", "2", "--compute-dtype", "fp32",
                                   "--params", "cpu", "--optimizer", "cpu", "--cpu-budget", "64MiB",
                                   "--device-budget", "64MiB", "--micro-batch", "400000",
                                   "--output", {str(tmp_path / 'out')!r}]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"--micro-batch 400000 x --seq-len 64: the forward and backward ran out of memory .*lower "
                     r"--micro-batch", err), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_an_unexpected_error_is_one_line_unless_debugging(monkeypatch, capsys):
    import argparse

    import offload.cli as cli

    def broken(args):
        raise RuntimeError("something\nwent wrong")

    class Parser:  # a subcommand failing in a way nobody foresaw
        def __init__(self, only=None):
            pass

        def parse_args(self, argv=None):
            return argparse.Namespace(command="plan", func=broken)

    monkeypatch.setattr(cli, "build_parser", Parser)
    assert main(["plan"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "offload plan: error: RuntimeError: something went wrong (OFFLOAD_DEBUG=1 shows the traceback)"
    monkeypatch.setenv("OFFLOAD_DEBUG", "1")
    with pytest.raises(RuntimeError, match="went wrong"):
        main(["plan"])
    monkeypatch.delenv("OFFLOAD_DEBUG")

    from offload.errors import InputError

    def refused(args):  # input the command refuses: exit 2, as argparse's own errors
        raise InputError("--x 3: must be even")

    Parser.parse_args = lambda self, argv=None: argparse.Namespace(command="plan", func=refused)
    assert main(["plan"]) == 2
    assert capsys.readouterr().err == "offload plan: error: --x 3: must be even\n"

    def bug(args):  # a ValueError from a bug is not bad input: exit 1, with its type and the hint
        raise ValueError("too many values to unpack")

    Parser.parse_args = lambda self, argv=None: argparse.Namespace(command="plan", func=bug)
    assert main(["plan"]) == 1
    assert "ValueError: too many values to unpack (OFFLOAD_DEBUG=1" in capsys.readouterr().err


# ---- --help -------------------------------------------------------------------------------------
def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


@pytest.mark.parametrize("command", ["finetune", "plan", "bench", "export"])
def test_help_is_complete(command):
    """Seven finetune flags had no help text or default; others printed '(default 150) (default: None)'."""
    parser = dict(_subparsers(build_parser()))[command]
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert missing == [], missing
    text = parser.format_help()
    assert "(default: None)" not in text
    for action in parser._actions:
        if action.help:
            assert action.help.count("default") <= 1, action.help
    for name, sub in _subparsers(parser):  # bench's own subcommands
        assert [a.option_strings[0] for a in sub._actions if a.option_strings and not a.help] == [], name
        assert "(default: None)" not in sub.format_help(), name

"""Every group's communicator is warmed (one tiny all-reduce each) before Runtime.open() measures the device
budget, and rt.stats() says what the communicators took of the device (collectives/warm.py; 0 on gloo)."""
import json
import textwrap

import rank_sequences


def test_the_groups_are_warmed_before_the_budgets_are_agreed(tmp_path):
    from zero_common import run_rank_script

    code = textwrap.dedent(f"""
        import json, os, torch
        import offload
        torch.distributed.init_process_group("gloo")
        with offload.init(offload.Config(params="cpu", optimizer="cpu", device_budget="64MiB",
                                         cpu_budget="64MiB")) as rt:
            taken = rt.stats()["communicators_device_bytes"]
        path = os.path.join({str(tmp_path)!r}, f"stats{{rt.rank}}.json")
        with open(path, "w") as f:
            json.dump({{"taken": taken}}, f)
        """)
    run_rank_script(code, tmp_path)
    assert [json.loads((tmp_path / f"stats{r}.json").read_text())["taken"] for r in range(2)] == [0, 0]
    seq = rank_sequences.load(str(tmp_path / "collectives"), 2)[0]
    assert [tuple(e) for e in seq["entries"][:3]] == [(g, "all_reduce", 1, "float32") for g in
                                                      ("main", "gather", "reduce")], seq["entries"][:4]
    assert seq["whats"][:4] == ["warm-up"] * 3 + ["the budgets and compute dtype every rank plans with"], seq["whats"]


def test_one_rank_warms_nothing():
    import offload

    with offload.init(offload.Config(params="cpu", optimizer="cpu", device_budget="64MiB", cpu_budget="64MiB")) as rt:
        assert rt.stats()["communicators_device_bytes"] == 0

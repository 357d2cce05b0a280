"""A collective entry point called on some ranks only (model.state_dict(), rt.full_state_dict(),
opt.full_state_dict() under `if rank == 0`) is refused on the calling rank within Config.agreement_timeout,
naming the fix, instead of hanging for collective_timeout; the other rank, in its next collective meanwhile,
goes on, and the runtime stays usable on both (offload/zero/collectives/agree.py)."""
import json
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_state_dict_on_rank_0_alone_is_refused_promptly_and_the_run_goes_on(tmp_path):
    from zero_common import run_rank_script

    code = textwrap.dedent(f"""
        import json, os, sys, time
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
        out = {{}}
        # collective_timeout 60 s: without the meeting, rank 0's gather waits that long for rank 1
        with offload.init(small_config(agreement_timeout="4s", collective_timeout="60s")) as rt:
            model = TinyTransformer()
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            step(model, opt, 0)
            if rt.rank == 0:  # rank 1 goes straight on to its next step's gathers (collectives)
                for name, call in (("full", lambda: rt.full_state_dict(model)), ("model", model.state_dict),
                                   ("opt", opt.full_state_dict)):
                    t0 = time.monotonic()
                    try:
                        call()
                        out[name] = ["returned", 0.0]
                    except offload.NotOnEveryRank as exc:
                        out[name] = [str(exc), time.monotonic() - t0]
            step(model, opt, 1)
            # every rank calls it, but not the same one: refused on both, at once
            try:
                model.state_dict() if rt.rank == 0 else rt.full_state_dict(model)
                out["mixed"] = "returned"
            except offload.NotOnEveryRank as exc:
                out["mixed"] = str(exc)
            step(model, opt, 2)
            full = rt.full_state_dict(model)  # a call on every rank meets and gathers
            out["sum"] = float(sum(v.double().sum() for v in full.values()))
        with open(os.path.join({str(tmp_path)!r}, f"rank{{rt.rank}}.json"), "w") as f:
            json.dump(out, f)
        """)
    run_rank_script(code, tmp_path, timeout=300)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for name, what in (("full", "rt.full_state_dict()"), ("model", "TinyTransformer.state_dict()"),
                       ("opt", "offload.AdamW.full_state_dict()")):
        message, waited = r0[name]
        assert message.startswith(f"offload: {what} was called on rank 0, and rank 1 (it is in "), message
        assert "did not call it within agreement_timeout=4 s: call it on every rank: it gathers shards from each" \
            in message and "\n" not in message, message
        assert 4.0 <= waited < 30.0, (name, waited)
    assert "the ranks called different collective entry points at once (rank 0: TinyTransformer.state_dict(), " \
        "rank 1: rt.full_state_dict())" in r0["mixed"], r0["mixed"]
    assert r1["mixed"] == r0["mixed"]
    assert r0["sum"] == r1["sum"]  # the same gathered values on both ranks after the refusals


def test_the_ranks_leave_save_pretrained_together_so_the_next_entry_point_meets(tmp_path):
    """save_pretrained: rank 0 writes after the last gather (here a tokenizer slow to save: 6 s, twice the agreement
    timeout); the other rank went straight on to the next entry point, whose meeting refused it while rank 0 was
    still writing. Every rank now leaves once rank 0 has written."""
    from zero_common import run_rank_script

    code = textwrap.dedent(f"""
        import json, os, sys, time
        import torch
        sys.path.insert(0, {str(TESTS)!r})
        import offload
        from offload.integrations.hf_model_dir import save_pretrained
        from zero_common import make_llama, small_config

        class SlowTokenizer:
            def save_pretrained(self, path):
                time.sleep(6.0)  # a slow disk under the last file
                open(os.path.join(path, "tokenizer.json"), "w").write("{{}}")

        torch.set_num_threads(1)
        with offload.init(small_config(compute_dtype="fp32", agreement_timeout="3s", collective_timeout="60s")) as rt:
            torch.manual_seed(0)
            model = rt.wrap(make_llama(tie=False))
            save_pretrained(rt, model, os.path.join({str(tmp_path)!r}, "out"), SlowTokenizer())
            full = rt.full_state_dict(model)  # the next entry point: every rank meets it
        with open(os.path.join({str(tmp_path)!r}, f"rank{{rt.rank}}.json"), "w") as f:
            json.dump({{"keys": len(full)}}, f)
        """)
    run_rank_script(code, tmp_path, timeout=300)
    assert (tmp_path / "out" / "tokenizer.json").exists() and (tmp_path / "out" / "config.json").exists()
    assert json.loads((tmp_path / "rank0.json").read_text()) == json.loads((tmp_path / "rank1.json").read_text())


def test_meetings_in_one_store_skip_an_abandoned_one_and_leave_few_keys():
    """Two ranks' meetings (threads here, over torch's in-memory store): three calls on both meet; a call on rank 0
    alone is refused within its timeout; the next call on both meets (rank 1 skips the abandoned meeting); each
    decided meeting's predecessor's keys are deleted."""
    import threading

    import torch.distributed as dist

    from offload.zero.collectives.agree import Agreement, NotOnEveryRank

    store = dist.HashStore()
    ranks = [Agreement(r, 2, 5.0, store) for r in range(2)]
    for a in ranks:
        a._base = "test/"  # (each runtime takes its own key space; these two stand for one runtime's two ranks)
    outcomes = []

    def call(r, what):
        try:
            ranks[r].meet(what)
            outcomes.append((r, what, "met"))
        except NotOnEveryRank as exc:
            outcomes.append((r, what, str(exc)))

    def both(what):
        threads = [threading.Thread(target=call, args=(r, what)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    for what in ("a()", "b()", "c()"):
        both(what)
    assert sorted(outcomes) == sorted((r, w, "met") for r in range(2) for w in ("a()", "b()", "c()"))
    assert store.num_keys() == 4  # the last meeting's verdict, count and the ranks' calls
    outcomes.clear()
    call(0, "solo()")
    assert outcomes[0][2].startswith("offload: solo() was called on rank 0, and rank 1 did not call it within "
                                     "agreement_timeout=5 s: call it on every rank"), outcomes
    both("d()")
    assert sorted(outcomes[1:]) == [(0, "d()", "met"), (1, "d()", "met")]

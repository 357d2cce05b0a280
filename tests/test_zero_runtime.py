"""offload.init behaviour: construction inside the block, unit discovery, gathered-memory bound, state
transitions, persistence, optimizer state dict, leaving the block, and the errors that must come early."""
import contextlib
import copy
import os
import sys
import time

import pytest
import torch
import torch.nn as nn

import offload
import offload.zero
from offload.zero.state_machines import UnitState
from offload.zero.units.discover import choose_unit_modules

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import DIM, SEQ, VOCAB, TinyTransformer, compute_loss, make_llama, transformers_available, one_torch_thread, small_config as _cfg  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_torch_thread()


def _ids(n=2, seed=0):
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _train(model, rt, steps=3, lr=1e-2):
    opt = offload.AdamW(model.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        loss = compute_loss(model, _ids(seed=s), "tiny")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return opt, losses


# ---- construction inside the block -------------------------------------------------------------
def test_build_inside_block_is_meta_until_used_then_materialized_per_unit():
    with offload.init(_cfg(seed=7)) as rt:
        model = TinyTransformer()
        # nothing real was kept: every parameter is a meta placeholder until the model is first used
        assert all(p.device.type == "meta" for p in model.parameters())
        assert model.head.weight is model.emb.weight  # ties survive construction
        assert model.layers[0].gain.device.type == "cpu"  # buffers are real
        params_before = list(model.parameters())
        opt = offload.AdamW(model.parameters(), lr=1e-2)  # first use: materialize + shard
        assert isinstance(opt, offload.zero.ShardedAdamW) and isinstance(opt, offload.AdamW)
        assert [u.name for u in rt.units] == ["", "layers.0", "layers.1"]
        assert list(model.parameters()) == params_before  # same objects: now the units' placeholders
        sd = rt.full_state_dict(model)
        assert torch.equal(sd["head.weight"], sd["emb.weight"])
        assert torch.equal(sd["layers.0.ln1.weight"], torch.ones(DIM))  # LayerNorm.reset_parameters
        bound = 1 / (DIM ** 0.5)  # nn.Linear's kaiming-uniform bound, fan_in = DIM
        assert sd["layers.0.attn.proj.weight"].abs().max() <= bound
        assert 0.5 < sd["emb.weight"].std() < 1.5  # nn.Embedding: N(0, 1)
        assert not model.frozen.weight.requires_grad
        loss = compute_loss(model, _ids(), "tiny")
        loss.backward()
        opt.step()
    # same seed, fresh build: the same values (what lets every rank materialize its own shard)
    with offload.init(_cfg(seed=7)) as rt2:
        again = TinyTransformer()
        rt2.materialize_pending()
        sd2 = rt2.full_state_dict(again)
    with offload.init(_cfg(seed=8)) as rt3:
        other = TinyTransformer()
        rt3.materialize_pending()
        sd3 = rt3.full_state_dict(other)
    fresh = _fresh_values(7)
    for name in ("emb.weight", "layers.1.mlp.0.weight", "layers.0.attn.qkv.weight"):
        assert torch.equal(sd[name], sd2[name]) and torch.equal(sd2[name], fresh[name])
        assert not torch.equal(sd2[name], sd3[name])


def _fresh_values(seed):
    with offload.init(_cfg(seed=seed)) as rt:
        m = TinyTransformer()
        m(_ids())  # the first forward materializes too
        return rt.full_state_dict(m)


def test_first_forward_materializes_and_training_reduces_loss():
    with offload.init(_cfg()):
        model = TinyTransformer()
        losses = []
        opt = None
        for s in range(8):
            loss = compute_loss(model, _ids(seed=0), "tiny")
            if opt is None:
                opt = offload.AdamW(model.parameters(), lr=3e-2)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0] * 0.7, losses


def test_torch_transformer_layers_built_inside_block_are_initialized_as_eager():
    """nn.MultiheadAttention registers torch.empty parameters and initializes them afterwards in its private
    _reset_parameters (xavier in_proj, zero biases, zero out_proj bias after out_proj's own init): built in
    the block, the same rules must hold (was: uninitialized memory, NaN loss)."""
    d, ff = 64, 128

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.TransformerEncoderLayer(d, 4, ff, dropout=0.0, batch_first=True,
                                                                    norm_first=True) for _ in range(2)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    eager = Stack()
    with offload.init(_cfg(seed=1)) as rt:
        model = Stack()
        out = model(torch.randn(2, 8, d))
        assert [u.name for u in rt.units] == ["layers.0", "layers.1"]
        assert torch.isfinite(out).all()
        sd = rt.full_state_dict(model)
    xavier = (6 / (d + 3 * d)) ** 0.5  # in_proj is (3d, d)
    for i in range(2):
        w = sd[f"layers.{i}.self_attn.in_proj_weight"]
        assert w.abs().max() <= xavier and w.std() > 0.5 * eager.layers[i].self_attn.in_proj_weight.std()
        assert torch.equal(sd[f"layers.{i}.self_attn.in_proj_bias"], torch.zeros(3 * d))
        assert torch.equal(sd[f"layers.{i}.self_attn.out_proj.bias"], torch.zeros(d))  # after out_proj's init
        assert torch.equal(sd[f"layers.{i}.norm1.weight"], torch.ones(d))
        assert sd[f"layers.{i}.linear1.weight"].abs().max() <= 1 / d ** 0.5  # nn.Linear's bound, fan_in = d
    for name, p in eager.named_parameters():
        assert sd[name].shape == p.shape


@pytest.mark.skipif(not transformers_available(), reason="transformers not installed")
def test_hf_llama_built_inside_block_uses_hf_init():
    with offload.init(_cfg(seed=3)) as rt:
        model = make_llama()
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        assert [u.name for u in rt.units][1:] == ["model.layers.0", "model.layers.1"]
        sd = rt.full_state_dict(model)
        std = model.config.initializer_range
        w = sd["model.layers.0.mlp.up_proj.weight"]
        assert abs(w.std().item() - std) < 0.3 * std  # HF _init_weights: N(0, initializer_range)
        assert torch.equal(sd["model.norm.weight"], torch.ones_like(sd["model.norm.weight"]))
        assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
        ids = _ids(seed=1)
        first = None
        for _ in range(5):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            first = first if first is not None else loss.item()
        assert loss.item() < first


# ---- unit discovery ----------------------------------------------------------------------------
def test_a_container_is_never_a_unit():
    """unit_min_bytes made a ModuleList of small heads a unit (its heads under the threshold, the list over): a list
    is never called, so its hooks never gathered it and the first head's call met placeholders. Containers leave
    their parameters to the module that calls their entries; the run is plain PyTorch's, bit for bit."""
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(16, 16)
            self.heads = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])  # 1088 bytes each, 4352 together

        def forward(self, x):
            x = self.inp(x)
            return sum(h(x) for h in self.heads)

    def run(wrapped: bool) -> list[float]:
        torch.manual_seed(0)
        model = Heads()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        with offload.init(_cfg(unit_min_bytes="2KiB")) if wrapped else contextlib.nullcontext() as rt:
            if wrapped:
                model = rt.wrap(model)
                assert [u.name for u in rt.units] == [""]
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for _ in range(3):
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses

    assert choose_unit_modules(Heads(), offload.Config(unit_min_bytes="2KiB")) == []
    assert run(wrapped=True) == run(wrapped=False)


def test_unit_policies():
    m = TinyTransformer()
    assert [n for n, _ in choose_unit_modules(m, offload.Config())] == ["layers.0", "layers.1"]
    assert [n for n, _ in choose_unit_modules(m, offload.Config(unit_classes=("Attention",)))] == [
        "layers.0.attn", "layers.1.attn"]
    # children first: attention (4*D*D + D params) and each MLP Linear (4*D*D + ...) reach 4*D*D on their
    # own, before the MLP (8*D*D) or the block (~13*D*D) is considered
    by_size = [n for n, _ in choose_unit_modules(m, offload.Config(unit_min_bytes=f"{4 * 4 * DIM * DIM}B"))]
    assert by_size == [f"layers.{i}.{x}" for i in (0, 1) for x in ("attn", "mlp.0", "mlp.2")]
    by_size = [n for n, _ in choose_unit_modules(m, offload.Config(unit_min_bytes=f"{10 * 4 * DIM * DIM}B"))]
    assert by_size == ["layers.0", "layers.1"]
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(DIM, 2, 32, batch_first=True), 3,
                                enable_nested_tensor=False)
    assert [n for n, _ in choose_unit_modules(enc, offload.Config())] == ["layers.0", "layers.1", "layers.2"]
    # an untied embedding and head at least as large as a block become units of their own (left in the root,
    # they would stay gathered all step and the root's update would hold back the next forward); a tied pair
    # stays in the root, and so do the small leftovers
    big = TinyTransformer(vocab=512)
    big.head.weight = nn.Parameter(big.head.weight.detach().clone())  # untie
    assert [n for n, _ in choose_unit_modules(big, offload.Config())] == ["emb", "layers.0", "layers.1", "head"]
    tied = TinyTransformer(vocab=512)
    assert [n for n, _ in choose_unit_modules(tied, offload.Config())] == ["layers.0", "layers.1"]
    with offload.init(_cfg()) as rt:
        rt.wrap(tied)
        assert [u.name for u in rt.units] == ["", "layers.0", "layers.1"]  # the tied weight is the root's


def test_transformer_encoder_stack_parity():
    torch.manual_seed(0)
    # bias=False: a key bias has zero gradient in exact arithmetic and Adam turns its rounding noise into
    # lr-sized steps, which no two summation orders reproduce
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True, bias=False),
                                3, enable_nested_tensor=False)
    model = copy.deepcopy(ref)
    x = torch.randn(4, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    target = torch.randn(4, SEQ, DIM, generator=torch.Generator().manual_seed(2))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with offload.init(_cfg()) as rt:
        rt.wrap(model)
        assert [u.name for u in rt.units] == ["layers.0", "layers.1", "layers.2"]  # no root params: no root unit
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for _ in range(4):
            for m, o in ((model, opt), (ref, ropt)):
                (m(x) - target).square().mean().backward()  # (not m(x)**2: LayerNorm makes it ~constant)
                o.step()
                o.zero_grad()
        sd = rt.full_state_dict(model)
    for name, p in ref.named_parameters():
        assert (sd[name] - p.detach()).norm() <= 1e-5 * p.detach().norm(), name


# ---- states, memory bound, persistence ---------------------------------------------------------
@pytest.mark.skipif(not transformers_available(), reason="transformers not installed")
def test_reentrant_checkpointing_gathers_within_the_bound_and_trains_as_non_reentrant():
    """A 6-block Llama with transformers' checkpointing, reentrant (DeepSpeed's checkpoint function, transformers
    4.x's default) and not: the recomputing forward inside the backward gathers each block again and frees it
    after its inner backward, so the gathered bytes stay within the stated bound (root and two blocks, not the
    seven units), and both train bit for bit alike."""
    from transformers import LlamaConfig, LlamaForCausalLM

    runs = {}
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2))
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.config.use_cache = False
        with offload.init(_cfg()) as rt:
            rt.wrap(model)
            opt = offload.AdamW(model.parameters(), lr=1e-3)
            losses = []
            for s in range(3):
                ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(s)).to(rt.device)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            st = rt.stats()
            every_unit = sum(u.nbytes_full for u in rt.units)
            runs[reentrant] = (losses, rt.full_state_dict(model))
        assert len(rt.units) == 7 and st["peak_gathered_bytes"] <= st["gathered_bound_bytes"] < every_unit / 2, st
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(runs[True][1][k], runs[False][1][k]) for k in runs[False][1])


@pytest.mark.parametrize("pipeline", [False, True])
def test_states_and_gathered_bound_during_forward_and_backward(pipeline):
    model = TinyTransformer(layers=4)
    seen = []
    with offload.init(_cfg(pipeline=pipeline)) as rt:
        rt.wrap(model)
        blocks = rt.units[1:]
        opt = offload.AdamW(model.parameters(), lr=1e-2)

        def observe(*_):
            seen.append(sum(u.state in (UnitState.UNSHARDED, UnitState.GATHERING) for u in blocks))

        for m in model.modules():
            m.register_forward_hook(lambda *a: observe())
        for layer in model.layers:  # observe in backward too: a hook on each block's input gradient
            layer.register_full_backward_pre_hook(lambda *a: observe())
        assert all(u.state is UnitState.SHARDED for u in rt.units)
        assert all(p.device.type == "meta" for p in model.parameters())
        for step in range(3):  # the first step is traced; the plan gathers ahead from the second on
            loss = compute_loss(model, _ids(seed=step), "tiny")
            kept = {u.uid for u in rt.units if u.state is not UnitState.SHARDED}
            if pipeline and step > 0:  # the root and the last block stay gathered for the backward right after
                assert kept == {rt.units[0].uid, blocks[-1].uid}, kept
            else:
                assert not kept  # freed after forward
            loss.backward()
            assert all(u.state is UnitState.SHARDED for u in rt.units)  # and after backward
            opt.step()
            opt.zero_grad()
        root, largest = rt.units[0].nbytes_full, max(u.nbytes_full for u in blocks)
        ahead = 2 if pipeline else 1  # with the pipeline, the next block is gathered while one computes
        assert max(seen) == ahead
        assert rt.gathered_bound() == root + ahead * largest
        assert rt.peak_gathered_bytes == root + ahead * largest  # the bound is reached, not loose
        assert rt.gathered_bytes == 0


def test_persistent_units_stay_gathered_and_track_updates():
    torch.manual_seed(0)
    ref = TinyTransformer()
    model = copy.deepcopy(ref)
    with offload.init(_cfg(persist_threshold="1MiB")) as rt:
        rt.wrap(model)
        assert all(u.persistent and u.state is UnitState.UNSHARDED for u in rt.units)
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for s in range(3):
            for m, o in ((model, opt), (ref, ropt)):
                loss = compute_loss(m, _ids(seed=s), "tiny")
                loss.backward()
                o.step()
                o.zero_grad()
            torch.testing.assert_close(compute_loss(model, _ids(seed=9), "tiny"),
                                       compute_loss(ref, _ids(seed=9), "tiny"), rtol=1e-5, atol=0)
        assert rt.gathered_bytes == sum(u.nbytes_full for u in rt.units)


def test_optimizer_state_dict_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    base = TinyTransformer()
    start = copy.deepcopy(base.state_dict())

    def run(steps, load=None):
        model = TinyTransformer()
        model.load_state_dict(load[0] if load else start)
        with offload.init(_cfg(optimizer="nvme", nvme_path=str(tmp_path))) as rt:
            rt.wrap(model)
            opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            if load:
                opt.load_state_dict(load[1])
            for s in steps:
                compute_loss(model, _ids(seed=s), "tiny").backward()
                rt.clip_grad_norm_(0.5)
                opt.step()
                opt.zero_grad()
            return rt.full_state_dict(model), opt.state_dict()

    straight, _ = run(range(5))
    mid_params, mid_opt = run(range(3))
    assert all(isinstance(v["exp_avg"], torch.Tensor) for v in mid_opt["state"].values())
    assert {v["step"].item() for v in mid_opt["state"].values()} == {3.0}
    resumed, _ = run(range(3, 5), load=({k: v for k, v in mid_params.items()}, mid_opt))
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name


def test_optimizer_follows_groups_added_or_loaded_after_it_stepped():
    """The optimizer indexes its parameters once (the backward looks units up in it) and again when its groups
    change: a group added after a step and groups replaced by load_state_dict (another lr) both take effect on
    the next step, as in torch."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    with offload.init(_cfg()) as rt:
        rt.wrap(model)
        params, ref_params = list(model.parameters()), list(ref.parameters())
        half = len(params) // 2
        opt = offload.AdamW(params[:half], lr=1e-2)
        ref_opt = torch.optim.AdamW(ref_params[:half], lr=1e-2)

        def step(seed):
            for m, o in ((model, opt), (ref, ref_opt)):
                compute_loss(m, _ids(seed=seed), "tiny").backward()
                o.step()
                o.zero_grad()

        step(0)
        opt.add_param_group({"params": params[half:]})
        ref_opt.add_param_group({"params": ref_params[half:]})
        step(1)
        loaded = []
        for o in (opt, ref_opt):
            sd = o.state_dict()
            for g in sd["param_groups"]:
                g["lr"] = 3e-2
            o.load_state_dict(sd)
            loaded.append([g["lr"] for g in o.param_groups])
        assert loaded == [[3e-2, 3e-2]] * 2
        step(2)
        got = rt.full_state_dict(model)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_model_to_moves_buffers_and_leaves_placeholders():
    model = TinyTransformer()
    with offload.init(_cfg()) as rt:
        rt.wrap(model)
        before = rt.full_state_dict(model)
        assert model.to("cpu") is model and model.float() is model  # no "cannot copy out of meta" error
        assert all(p.device.type == "meta" for p in model.parameters())
        assert model.layers[0].gain.device.type == "cpu"
        _train(model, rt, steps=1)
        assert not torch.equal(before["layers.0.mlp.0.weight"], rt.full_state_dict(model)["layers.0.mlp.0.weight"])


def test_unused_parameters_are_not_stepped():
    """torch.optim.AdamW skips params whose grad is None (no decay, no moment update): so must we."""
    model = TinyTransformer()
    with offload.init(_cfg()) as rt:
        rt.wrap(model)
        before = rt.full_state_dict(model)
        _train(model, rt, steps=2)
        after = rt.full_state_dict(model)
    assert torch.equal(before["layers.0.unused.weight"], after["layers.0.unused.weight"])
    assert torch.equal(before["frozen.weight"], after["frozen.weight"])
    assert not torch.equal(before["layers.0.mlp.0.weight"], after["layers.0.mlp.0.weight"])


# ---- leaving the block -------------------------------------------------------------------------
def test_leaving_frees_everything_and_use_after_raises(tmp_path):
    model = TinyTransformer()
    with offload.init(_cfg(params="nvme", optimizer="nvme", nvme_path=str(tmp_path))) as rt:
        rt.wrap(model)
        opt, _ = _train(model, rt, steps=1)
        run_dir = rt.states.run_dir
        assert any(run_dir.iterdir())  # swap files exist while open
    assert not run_dir.exists()  # swap files and the run directory are gone
    assert list(tmp_path.iterdir()) == []
    assert all(u.state is UnitState.FREED for u in rt.units)
    assert rt.gathered_bytes == 0
    assert nn.Module.register_parameter.__qualname__ == "Module.register_parameter"  # patch undone
    with pytest.raises(RuntimeError, match="exited"):
        model(_ids())
    with pytest.raises(RuntimeError, match="exited"):
        opt.step()
    with pytest.raises(RuntimeError, match="exited"):
        rt.wrap(TinyTransformer())
    # outside the block, modules are built as usual (real parameters)
    assert nn.Linear(2, 2).weight.device.type == "cpu"


# ---- errors that come before any training ------------------------------------------------------
def test_unit_larger_than_device_budget_is_named():
    model = TinyTransformer()
    block = sum(p.numel() for p in model.layers[0].parameters()) * 4
    with offload.init(_cfg(device_budget=f"{block - 1}B")) as rt:
        with pytest.raises(MemoryError, match=r"unit 1 \(layers\.0, Block\) needs .* \(\d+ bytes\).*device_budget"):
            rt.wrap(model)


def test_nvme_path_missing_fails_at_init(tmp_path):
    with pytest.raises(FileNotFoundError, match="nvme_path.*does not exist"):
        offload.init(_cfg(params="nvme", nvme_path=str(tmp_path / "nope"))).__enter__()


def test_nvme_path_read_only_fails_at_init(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        writable = os.access(ro, os.W_OK)  # root ignores the mode bits
        path = "/proc/self" if writable else str(ro)  # procfs: no new files, even for root
        with pytest.raises(PermissionError, match="nvme_path.*not writable"):
            offload.init(_cfg(optimizer="nvme", nvme_path=path)).__enter__()
    finally:
        ro.chmod(0o700)


def test_nvme_path_too_small_fails_with_numbers(tmp_path):
    with pytest.raises(OSError, match=r"has .* \(\d+ bytes\) free but nvme_budget needs .* \(\d+ bytes\)"):
        offload.init(_cfg(params="nvme", nvme_path=str(tmp_path), nvme_budget="1000TiB")).__enter__()
    model = TinyTransformer()
    with offload.init(_cfg(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), nvme_budget="4KiB")) as rt:
        with pytest.raises(OSError, match=r"need .* \(\d+ bytes\).*nvme_budget is 4.00 KiB \(4096 bytes\)"):
            rt.wrap(model)


def test_the_auto_nvme_budget_is_the_one_rule_and_placement_keeps_to_it(tmp_path, monkeypatch):
    """The store's "auto" nvme budget (90% of the free space, split among this node's ranks) is what
    placement checks the model against: a drive with room for the states but not within 90% of its free
    space is refused at wrap, naming the rule, not at the first opt.step() with a SwapSpaceError."""
    import shutil

    model = TinyTransformer()
    with offload.init(_cfg(params="nvme", optimizer="nvme", nvme_path=str(tmp_path))) as rt:
        rt.wrap(model)
        used = rt.states.stats()["nvme"]["bytes_in_use"]
        free_before = shutil.disk_usage(tmp_path).free + used  # as it was before this run's swap files
        assert rt.stats()["budgets"]["nvme"] == rt.budgets["nvme"]
        assert abs(rt.budgets["nvme"] - 0.9 * free_before) < 0.01 * free_before
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=int(used / 0.95)))  # >= used, 90% < used
    with offload.init(_cfg(params="nvme", optimizer="nvme", nvme_path=str(tmp_path))) as rt:
        with pytest.raises(OSError, match=r"nvme_budget is .*90% of nvme_path's free space"):
            rt.wrap(TinyTransformer())
    from offload.store import nvme_budget_bytes, ranks_on_this_node

    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=8 << 30))
    assert nvme_budget_bytes("auto", str(tmp_path), ranks_sharing=4) == int((8 << 30) * 0.9 / 4)  # each a quarter
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")  # the launchers' words for the ranks on this node
    assert ranks_on_this_node(16) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's first
    assert ranks_on_this_node(16) == 4
    assert ranks_on_this_node(1) == 1  # a lone process in a bigger allocation is one rank: its budgets unsplit
    with offload.init(_cfg(params="nvme", nvme_path=str(tmp_path))) as rt:
        assert rt.budgets["nvme"] == int((8 << 30) * 0.9)


def test_budgets_larger_than_the_machine_are_refused_at_init():
    """The README's example budgets on a smaller machine died inside torch's allocator."""
    from offload.store import host_memory

    total, _ = host_memory()
    with pytest.raises(ValueError, match=r"offload.Config.cpu_budget: .* more host memory than this machine has"):
        offload.init(_cfg(cpu_budget=f"{total + (1 << 30)}B")).__enter__()
    with pytest.raises(ValueError, match=r"device_budget \+ .*cpu_budget: .*without a GPU the device tier is a region "
                                         r"of host memory"):
        offload.init(_cfg(device_budget=f"{total // 2 + (1 << 30)}B", cpu_budget=f"{total // 2}B")).__enter__()


def test_a_killed_runs_swap_is_removed_at_the_next_init(tmp_path, caplog):
    """kill -9 cannot clean up after itself: its run directory (swap files) stays until the next run on that
    nvme_path finds it unlocked and removes it, saying so; a live run's directory is left alone."""
    import logging
    import signal
    import subprocess
    import textwrap

    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import offload
        from zero_common import TinyTransformer, small_config
        rt = offload.init(small_config(params="nvme", optimizer="nvme", nvme_path={str(tmp_path)!r})).__enter__()
        rt.wrap(TinyTransformer())
        print(rt.states.run_dir, flush=True)
        time.sleep(600)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    dirs = [p.stdout.readline().strip() for p in procs]
    try:
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=60)
        dead, live = (tmp_path / os.path.basename(d) for d in dirs)
        assert any(dead.glob("*.swap"))
        with caplog.at_level(logging.WARNING, logger="offload"):
            with offload.init(_cfg(params="nvme", nvme_path=str(tmp_path))) as rt:
                assert not dead.exists() and live.is_dir() and rt.states.run_dir.is_dir()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert f"removed {dead}" in caplog.text and f"pid {procs[0].pid}" in caplog.text


def test_stats_say_where_host_memory_is(tmp_path):
    """rt.stats()["memory"]: the resident set against what the budgets hold; memory taken outside them (here a
    256 MiB tensor of the training loop's own) shows as outside_budgets_bytes, and goes when it is freed (to the OS, or
    into the host pool's cache)."""
    model = TinyTransformer()
    with offload.init(_cfg(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), cpu_budget="64MiB")) as rt:
        rt.wrap(model)
        _train(model, rt, steps=2)
        rt.quiesce()
        before = rt.stats()["memory"]
        extra = torch.ones(64 << 20)  # 256 MiB, every page written
        during = rt.stats()["memory"]
        del extra
        after = rt.stats()["memory"]
    assert before["rss_at_open_bytes"] > 0 and before["host_budget_tiers"] == ("cpu", "device")
    assert 0 < before["budgets_peak_bytes"]["cpu"] <= 64 << 20
    assert before["budgets_in_use_bytes"]["nvme"] > 0
    cpu = before["held"]["cpu"]  # what the cpu tier holds: the nvme-homed states kept resident, by class
    assert cpu["homes"] == {} and set(cpu["copies"]) <= {"params", "optim", "grads"} and cpu["copies"]
    assert sum(cpu["copies"].values()) + cpu["other"] == before["budgets_in_use_bytes"]["cpu"] and cpu["moving"] == 0
    grew = during["outside_budgets_bytes"] - before["outside_budgets_bytes"]
    assert (256 - 16) << 20 <= grew <= (256 + 16) << 20, grew
    # freed: given back to the OS (glibc maps a block this size), or, with the host pool (a CPU run's default),
    # kept in its cache, which the same stats report
    def not_cached(m):
        return m["outside_budgets_bytes"] - (m["host_pool"] or {}).get("cached_bytes", 0)

    assert not_cached(after) < not_cached(during) - (200 << 20), (during, after)


def test_auto_tiers_follow_budgets(tmp_path):
    with offload.init(_cfg(params="auto", optimizer="auto")) as rt:
        rt.wrap(TinyTransformer())
        assert (rt.params_tier, rt.optimizer_tier) == ("device", "cpu")
    # 96 KiB: the lanes' working set for nvme params and states, not enough to also hold the params at home
    with offload.init(_cfg(params="auto", optimizer="auto", device_budget="48KiB", cpu_budget="96KiB",
                           nvme_path=str(tmp_path))) as rt:
        rt.wrap(TinyTransformer())
        assert (rt.params_tier, rt.optimizer_tier) == ("nvme", "nvme")
    with offload.init(_cfg(params="auto", optimizer="auto", device_budget="48KiB", cpu_budget="100KiB",
                           nvme_path=str(tmp_path))) as rt:
        rt.wrap(TinyTransformer())
        assert (rt.params_tier, rt.optimizer_tier) == ("cpu", "nvme")
    with offload.init(_cfg(params="cpu", optimizer="cpu", cpu_budget="8KiB")) as rt:
        with pytest.raises(MemoryError, match="cpu_budget"):
            rt.wrap(TinyTransformer())
    with offload.init(_cfg(params="nvme", optimizer="nvme", cpu_budget="16KiB", nvme_path=str(tmp_path))) as rt:
        with pytest.raises(MemoryError, match=r"cpu_budget: with params='nvme' and optimizer='nvme' this rank "
                                              r"needs 96.00 KiB \(98304 bytes\)"):
            rt.wrap(TinyTransformer())


def _mostly_frozen() -> nn.Module:
    """Four frozen 256x256 layers (a LoRA base: 1 MiB of fp32 parameters) and one small trainable one."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)], nn.Linear(256, 16, bias=False))
    for layer in model[:4]:
        layer.requires_grad_(False)
    return model


def test_frozen_units_are_sized_and_homed_without_gradients_or_moments(tmp_path):
    """A frozen unit never has a gradient or a moment. The placement counted both for every unit (an explicit
    optimizer='cpu' refused where the base's parameters fit), and with the gradients in another tier than the
    optimizer's their shards were registered for frozen units too, held for the whole run."""
    units = dict(unit_classes=(nn.Linear,), persist_threshold=0)
    with offload.init(_cfg(params="cpu", optimizer="cpu", cpu_budget="1280KiB", **units)) as rt:
        model = rt.wrap(_mostly_frozen())  # 1 MiB frozen + 16 KiB trained and its 48 KiB of states
        opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        assert rt.states.nbytes_in("cpu") <= (1024 + 16 + 48 + 16) * 1024  # (+ one unit's padding to 256 x 4 KiB)
    with offload.init(_cfg(params="cpu", optimizer="nvme", grads="cpu", cpu_budget="8MiB", nvme_path=str(tmp_path),
                           **units)) as rt:
        rt.wrap(_mostly_frozen())
        assert rt.states.nbytes_in("cpu") == 1024 * 1024 + 16 * 1024 + 16 * 1024  # params and the trained one's grad


def test_optimizer_on_the_device_is_counted_against_the_device_budget():
    """optimizer='device' (DeepSpeed's stage 3 without offload) keeps the master, gradient and moments in the
    device tier: the wrap counted only the parameter shards and the gathered units, accepted, and the run failed
    at its first reduce or step (on a GPU with an "auto" budget: out of memory)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)])  # 1 MiB of fp32 parameters

    units = dict(unit_classes=(nn.Linear,), persist_threshold=0, params="device", optimizer="device")
    with offload.init(_cfg(device_budget="2MiB", **units)) as rt:  # the params and a unit gathered: 1.25 MiB
        with pytest.raises(MemoryError, match=r"device_budget: params='device' keeps 1.00 MiB .* and "
                                              r"optimizer='device' keeps 3.00 MiB .* of fp32 master, gradient and "
                                              r"optimizer states on the device .* raise device_budget or set "
                                              r"params='cpu' / 'nvme' / optimizer='cpu' / 'nvme'"):
            rt.wrap(model())
    with offload.init(_cfg(device_budget="5MiB", **units)) as rt:
        m = rt.wrap(model())
        opt = offload.AdamW(m.parameters(), lr=1e-2)
        m(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        assert rt.states.nbytes_in("device") >= 4 << 20  # the states, all four kinds, in the device tier


def test_ranks_agree_their_budgets_before_any_store_is_built(tmp_path):
    """Each rank built its store (its pinned arena) with its own budgets and only then agreed the smallest: a rank
    pinned memory it never planned with, and its arena shrank the host memory that ranks starting after it read
    for their "auto" budgets. Given 64 MiB on rank 0 and 32 MiB on rank 1, both stores now hold 32 MiB."""
    import json
    import textwrap

    from zero_common import run_rank_script

    code = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import offload
        from zero_common import small_config
        rank = int(os.environ["RANK"])
        with offload.init(small_config(cpu_budget="64MiB" if rank == 0 else "32MiB")) as rt:
            seen = {{"rank": rank, "capacity": rt.states.capacity("cpu"), "planned": rt.budgets["cpu"]}}
        with open(os.path.join({str(tmp_path)!r}, f"rank{{rank}}.json"), "w") as f:  # (one stdout: lines mix)
            json.dump(seen, f)
    """)
    run_rank_script(code, tmp_path)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["capacity"] == r["planned"] == 32 << 20 for r in seen), seen


def test_auto_params_leave_half_an_auto_device_budget_to_the_activations():
    """params='auto' put the parameter shards on the device whenever they and two gathered units fit an "auto"
    device budget, whose room for the activations is unknown at wrap (and a shard's home never moves): a model
    filling most of the GPU ran out of memory at its first forward. Under "auto" they now take half of it at most
    (as the gradients under "auto" go there only within a given budget); a budget the user gave is used whole."""
    import torch.nn as nn

    from offload.zero import placement
    from offload.zero.units.layout import FlatLayout

    layers = [nn.Linear(512, 512, bias=False) for _ in range(8)]  # 8 units of 1 MiB in fp32: 8 MiB of shards
    sizes = [placement.UnitSize(i, f"l{i}", "Linear", FlatLayout([(m.weight, [], f"l{i}.weight")], 1), False)
             for i, m in enumerate(layers)]

    def params_tier(device_budget: int, given: bool) -> str:
        budgets = {"device": device_budget, "cpu": 1 << 30, "nvme": None}
        place = placement.plan(sizes, sizes, "auto", "cpu", budgets, {"device": 0, "cpu": 0}, torch.float32, None,
                               None, device_budget_given=given)
        return place.tiers.params.value

    assert params_tier(12 << 20, given=True) == "device"  # 8 MiB + 2 units gathered: 10 of 12 MiB
    assert params_tier(12 << 20, given=False) == "cpu"  # more than half of an "auto" 12 MiB
    assert params_tier(24 << 20, given=False) == "device"  # within half of an "auto" 24 MiB


def test_auto_tiers_take_the_pair_the_step_model_predicts_fastest(tmp_path):
    """140 KiB of cpu budget holds the params at home with the optimizer's states paged (what taking the
    fastest tier for params first gives) or the optimizer's states at home with the params paged: "auto"
    takes the second, whose data movement the plan's step model predicts faster, and it does move fewer
    bytes to and from the disk, for the same results. Synchronous runs (Config.pipeline=False): what a pipelined
    run's read-ahead moves in so small a budget varies with its timing (the greedy pair once moved 300 KiB against
    auto's 316, under load, in 1 of many runs); synchronous, auto moved 388-416 KiB and greedy 470-512 in 8 runs."""
    def run(**tiers):
        cfg = _cfg(device_budget="48KiB", cpu_budget="140KiB", nvme_path=str(tmp_path), pipeline=False, **tiers)
        torch.manual_seed(0)
        model = TinyTransformer()
        with offload.init(cfg) as rt:
            rt.wrap(model)
            opt = offload.AdamW(model.parameters(), lr=1e-2)
            for step in range(3):
                compute_loss(model, _ids(step), "tiny").backward()
                opt.step()
                opt.zero_grad()
            stats = rt.stats()
            return (rt.params_tier, rt.optimizer_tier), rt.placement.considered, stats, rt.full_state_dict(model)

    tiers, considered, auto, values = run(params="auto", optimizer="auto")
    assert tiers == ("nvme", "cpu"), considered
    predicted = {(p, o): t for p, o, t in considered}
    assert predicted[("nvme", "cpu")] < predicted[("cpu", "nvme")] and ("cpu", "cpu") not in predicted
    _, _, greedy, greedy_values = run(params="cpu", optimizer="nvme")
    moved = {name: s["nvme_read_bytes"] + s["nvme_written_bytes"] for name, s in (("auto", auto), ("greedy", greedy))}
    assert moved["auto"] < moved["greedy"], moved
    assert values.keys() == greedy_values.keys() and all(torch.equal(values[k], greedy_values[k]) for k in values)


def test_auto_tiers_read_the_machine_figures_from_a_bench_json(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text('{"nvme": {"read_gbps": 0.5, "write_gbps": 0.25}, "adam": {"offload_params_per_s": 1e8}}')
    cfg = _cfg(params="auto", optimizer="auto", device_budget="48KiB", cpu_budget="140KiB",
               nvme_path=str(tmp_path), machine=str(bench))
    with offload.init(cfg) as rt:
        rt.wrap(TinyTransformer())
        assert (rt.machine.nvme_read_Bps, rt.machine.nvme_write_Bps) == (0.5e9, 0.25e9)
        assert rt.machine.adam_params_per_s == 1e8
        slow = dict(((p, o), t) for p, o, t in rt.placement.considered)
    with offload.init(cfg.__class__(**{**cfg.__dict__, "machine": None})) as rt:
        rt.wrap(TinyTransformer())
        nominal = dict(((p, o), t) for p, o, t in rt.placement.considered)
    assert slow[("nvme", "nvme")] > 10 * nominal[("nvme", "nvme")]  # 50x slower drive than the nominal 25 GB/s
    with pytest.raises(ValueError, match=r"offload.Config.machine .*missing.json: cannot read it .* offload bench"):
        _cfg(machine=str(tmp_path / "missing.json"))


def test_auto_tiers_predict_the_update_mode_the_run_uses(tmp_path):
    """With Config.update_in_backward the update runs under the backward, so where the CPU Adam binds (a slow
    one, from a bench JSON) a placement that reads params from nvme in the backward is predicted faster than
    the default step, whose update waits for the whole backward."""
    bench = tmp_path / "bench.json"
    bench.write_text('{"adam": {"offload_params_per_s": 1e5}}')

    def considered(update_in_backward: bool) -> dict:
        cfg = _cfg(params="auto", optimizer="auto", device_budget="48KiB", cpu_budget="140KiB",
                   nvme_path=str(tmp_path), machine=str(bench), update_in_backward=update_in_backward)
        with offload.init(cfg) as rt:
            rt.wrap(TinyTransformer())
            return {(p, o): t for p, o, t in rt.placement.considered}

    default, in_backward = considered(False), considered(True)
    assert default.keys() == in_backward.keys() and ("nvme", "cpu") in default
    assert in_backward[("nvme", "cpu")] < default[("nvme", "cpu")], (default, in_backward)
    assert all(in_backward[k] <= default[k] for k in default), (default, in_backward)


def test_optimizer_rejects_foreign_params():
    plain = nn.Linear(2, 2)  # built outside: real, not the runtime's
    with offload.init(_cfg()) as rt:
        model = rt.wrap(TinyTransformer())
        with pytest.raises(ValueError, match="not owned by an offload runtime"):
            offload.zero.ShardedAdamW(list(model.parameters()) + list(plain.parameters()))
    # plain parameters outside any runtime keep the plain fused optimizer
    assert type(offload.AdamW(nn.Linear(2, 2).parameters())) is offload.AdamW


class _BadBatch(Exception):
    pass


@contextlib.contextmanager
def _four_blocks(cfg):
    """(rt, model, opt): a 4-block TinyTransformer wrapped under `cfg`, and its AdamW (the fault tests' run)."""
    torch.manual_seed(0)
    model = TinyTransformer(layers=4)
    with offload.init(cfg) as rt:
        rt.wrap(model)
        yield rt, model, offload.AdamW(model.parameters(), lr=1e-2)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))


def _values(rt, model) -> dict:
    return {k: v.clone() for k, v in rt.full_state_dict(model).items()}


def _assert_bitwise(want, got) -> None:
    """(losses, values) of two runs: equal bit for bit."""
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][k], want[1][k]) for k in want[1])


@pytest.mark.parametrize("where", ["block", "head"])
def test_a_forward_that_raises_frees_what_it_gathered_and_the_run_goes_on(where):
    """An out-of-memory error or a bad batch in the middle of the forward: nothing of it reaches a backward, so
    what it gathered is freed as the error leaves the model (the retry with a smaller batch, accelerate's
    find_executable_batch_size, starts with nothing held; before, the failing unit, the one gathered ahead and
    the root stayed gathered until the next forward). The run then goes on bit for bit as if the batch had been
    left out."""
    def run(fail):
        with _four_blocks(_cfg()) as (rt, model, opt):
            held_when_raised = []

            def refuse(module, args):
                if step == 1 and fail:
                    held_when_raised.append(rt.gathered_bytes)
                    raise _BadBatch

            (model.layers[2] if where == "block" else model.ln_f).register_forward_pre_hook(refuse)
            losses = []
            for step in range(4):
                if step == 1 and not fail:
                    continue  # the reference leaves the batch out
                try:
                    loss = compute_loss(model, _batch(step), "tiny")
                except _BadBatch:
                    assert held_when_raised[0] > 0 and rt.gathered_bytes == 0, (held_when_raised, rt.gathered_bytes)
                    opt.zero_grad()
                    continue
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses, _values(rt, model)

    want, got = run(False), run(True)
    assert len(got[0]) == 3
    _assert_bitwise(want, got)


def test_ctrl_c_while_waiting_for_a_gather_keeps_the_accounting_and_the_run():
    """A KeyboardInterrupt (Ctrl-C in a notebook; here SIGALRM's handler raises it) while the training thread waits
    for a gather the lane has not finished: the unit stays GATHERING and the next wait lets the lane finish. Before,
    the buffer was freed under the lane, which grew it back uncounted: the gathered-bytes counter went negative
    for good and a SHARDED unit held a full buffer. Then the run goes on as if the batch had been left out."""
    import signal

    from offload import inject
    from offload.telemetry import Queue

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    def allocated(rt):
        return sum(u.flat.untyped_storage().nbytes() for u in rt.units if not u.persistent)

    def run(interrupted):
        with _four_blocks(_cfg()) as (rt, model, opt):
            losses = []
            for step in range(4):
                ids = _batch(step)
                if step == 1 and not interrupted:
                    continue  # the reference leaves the batch out
                if step == 1:
                    previous = signal.signal(signal.SIGALRM, interrupt)
                    try:
                        with inject.delay(Queue.GATHER, 0.4), pytest.raises(KeyboardInterrupt):
                            signal.setitimer(signal.ITIMER_REAL, 0.6)  # inside the second unit's wait
                            compute_loss(model, ids, "tiny").backward()
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                        signal.signal(signal.SIGALRM, previous)
                    opt.zero_grad()
                    time.sleep(0.5)  # the lane finishes what it had
                    assert rt.gathered_bytes == allocated(rt) >= 0, (rt.gathered_bytes, allocated(rt))
                    continue
                loss = compute_loss(model, ids, "tiny")
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                assert rt.gathered_bytes == allocated(rt), (rt.gathered_bytes, allocated(rt))
            return losses, _values(rt, model)

    want, got = run(False), run(True)
    assert len(got[0]) == 3
    _assert_bitwise(want, got)


def test_an_update_that_fails_names_what_it_left_and_a_checkpoint_load_in_process_repairs_it(tmp_path):
    """A corrupt swap file (the drive, or anything writing into it) makes step 2's update fail on the optimizer
    lane. The next forward raises UpdateFailed naming the unit and the cause (before: the bare store error, at
    every later step, from rt.save_checkpoint and from rt.load_checkpoint too, so only a new process could go
    on). The part-updated states are not saved; rt.load_checkpoint in the same process replaces them, and the
    run from there is bit for bit the one that never failed."""
    import glob

    def run(corrupt):
        swap = tmp_path / f"swap{corrupt}"
        swap.mkdir()
        # optimizer states on nvme, the cpu budget at the least the placement takes: they page every step
        cfg = _cfg(optimizer="nvme", nvme_path=str(swap), cpu_budget="136KiB", chunk_size="16KiB",
                   speculative_updates=False)
        with _four_blocks(cfg) as (rt, model, opt):
            def step(s, damage=False):
                loss = compute_loss(model, _batch(s), "tiny")
                loss.backward()
                if damage:
                    for f in glob.glob(f"{swap}/**/*.swap", recursive=True):
                        with open(f, "r+b") as fh:
                            fh.write(os.urandom(os.path.getsize(f)))
                opt.step()
                opt.zero_grad()
                return loss.item()

            losses = [step(0), step(1)]
            rt.save_checkpoint(tmp_path / f"ckpt{corrupt}")
            if corrupt:
                step(2, damage=True)  # its update fails on the lane, after opt.step() returned
                # which unit's update meets a damaged file first follows the lanes' timing (once, under load, the root)
                unit = r"unit \d \((layers\.\d|<root>)\)"
                with pytest.raises(offload.UpdateFailed, match=rf"the optimizer update of {unit} failed "
                                   r"\(SwapCorruptError: .*part-updated.*rt\.load_checkpoint") as failed:
                    step(3)
                assert isinstance(failed.value.__cause__, offload.store.SwapCorruptError)
                opt.zero_grad()
                with pytest.raises(offload.UpdateFailed):
                    rt.save_checkpoint(tmp_path / "never")  # the part-updated states are not saved
                rt.load_checkpoint(tmp_path / f"ckpt{corrupt}")
            losses += [step(2), step(3)]
            return losses, _values(rt, model)

    _assert_bitwise(run(False), run(True))

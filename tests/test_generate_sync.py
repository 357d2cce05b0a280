"""generate() of a wrapped Hugging Face model on 2 ranks whose generations end at different lengths: transformers
syncs the ranks only for DeepSpeed ZeRO-3 or FSDP models, so the rank that stopped first left the other's gathers
unpaired. With a runtime of 2 ranks open, a wrapped model's generate() runs with synced_gpus=True
(offload/integrations/generate_sync.py): both ranks finish, each with its plain model's greedy tokens."""
import json
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def test_generate_on_two_ranks_of_different_lengths_completes_with_the_plain_models_tokens(tmp_path):
    pytest.importorskip("transformers")
    from zero_common import run_rank_script

    code = textwrap.dedent(f"""
        import json, os, sys
        import torch
        sys.path.insert(0, {str(TESTS)!r})
        import offload
        from zero_common import VOCAB, make_llama, small_config

        torch.set_num_threads(1)
        rank = int(os.environ["RANK"])
        new = 3 if rank == 0 else 8  # rank 0 stops 5 tokens before rank 1
        ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(10 + rank))
        settings = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        # agreement_timeout / collective_timeout: a rank left alone fails the test in seconds, not minutes
        with offload.init(small_config(compute_dtype="fp32", agreement_timeout="10s", collective_timeout="60s")) as rt:
            torch.manual_seed(0)
            model = make_llama(tie=False)  # built inside the block, wrapped at its first forward (in generate)
            with torch.no_grad():
                out = model.generate(input_ids=ids, **settings)
            full = rt.full_state_dict(model)
        plain = make_llama(tie=False)
        plain.load_state_dict(full)
        with torch.no_grad():
            ref = plain.generate(input_ids=ids, **settings)
        with open(os.path.join({str(tmp_path)!r}, f"rank{{rank}}.json"), "w") as f:
            json.dump({{"out": out.tolist(), "ref": ref.tolist()}}, f)
        """)
    run_rank_script(code, tmp_path, timeout=300)
    for rank, new in ((0, 3), (1, 8)):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(got["out"][0]) == 5 + new, got
        assert got["out"] == got["ref"], got

"""The recorded collective sequences (tests/rank_sequences.py) catch ranks that issue different collectives even
where gloo pairs them without an error, and the runtime records what it issues in the order it enqueues it."""
import textwrap

import pytest
import torch

import rank_sequences
from offload.zero.collectives import comm


def test_ranks_whose_collectives_gloo_pairs_silently_are_caught_at_teardown(tmp_path):
    """A float32 all-reduce on rank 0 and an int32 one of the same bytes on rank 1: gloo sums the bits and says
    nothing (rank 0 reads 1065353216-like garbage); the ranks' recorded sequences differ at that collective."""
    from zero_common import run_rank_script

    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from offload.zero.collectives import comm
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        group = comm.Group(rank, 2, name="main")
        comm.all_reduce_(group, torch.ones(3), what="alike")
        comm.all_reduce_(group, torch.ones(4) if rank == 0 else torch.ones(4, dtype=torch.int32), what="apart")
        dist.destroy_process_group()
        """)
    run_rank_script(code, tmp_path, same_collectives=False)
    prefix = str(tmp_path / "collectives")
    differ = rank_sequences.first_difference(rank_sequences.load(prefix, 2))
    assert differ == ("collective #1: rank 0 issued 'apart' ('main', 'all_reduce', 4, 'float32'), rank 1 issued "
                      "'apart' ('main', 'all_reduce', 4, 'int32') (2 and 2 collectives in all)"), differ
    with pytest.raises(AssertionError, match="the ranks issued different collectives: collective #1"):
        rank_sequences.assert_same_sequences(prefix)


def test_a_rank_that_issued_more_is_named():
    seqs = [{"entries": [["gather", "all_gather", 8, "float32"]], "whats": ["unit 0"]},
            {"entries": [["gather", "all_gather", 8, "float32"], ["main", "all_reduce", 5, "int64"]],
             "whats": ["unit 0", "flags"]}]
    assert rank_sequences.first_difference(seqs) == (
        "collective #1: rank 0 issued nothing, rank 1 issued 'flags' ('main', 'all_reduce', 5, 'int64') "
        "(1 and 2 collectives in all)")
    assert rank_sequences.first_difference([seqs[1], seqs[1]]) is None


def test_nothing_is_recorded_outside_a_recording_or_at_one_rank():
    group = comm.Group()
    with comm.recording() as recorder:
        comm.all_reduce_(group, torch.ones(2))  # one rank: no collective issued
    assert recorder.entries == [] and comm._recorders == []

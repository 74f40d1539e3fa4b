"""Pure helpers of the GRPO step: step uids, batch rows, combining the optimizer steps' metrics."""
from hypothesis import given, settings, strategies as st

from rldispatch.metrics import combine_update_metrics
from rldispatch.prompts import batch_indices, step_uids


def test_step_uids_are_fresh_valid_and_reproducible():
    a, b = step_uids(0, 3, 16), step_uids(0, 3, 16)
    assert a == b and len(set(a)) == 16 and all("_" not in u and len(u) == 32 for u in a)
    assert not set(a) & set(step_uids(0, 4, 16)) and not set(a) & set(step_uids(0, 3, 16, "val"))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(4, 60), batch=st.integers(1, 4), seed=st.integers(0, 5), shuffle=st.booleans())
def test_batch_indices_cover_each_epoch_once(rows, batch, seed, shuffle):
    per_epoch = rows // batch
    for epoch in range(2):
        seen = [i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch)
                for i in batch_indices(rows, batch, s, seed, shuffle)]
        assert len(seen) == len(set(seen)) == per_epoch * batch and all(0 <= i < rows for i in seen)
    assert batch_indices(rows, batch, 1, seed, shuffle) == batch_indices(rows, batch, 1, seed, shuffle)


def test_combine_update_metrics():
    out = combine_update_metrics([{"loss": 1.0, "tokens": 10, "lr": 0.1, "grad_norm": None},
                                  {"loss": 3.0, "tokens": 5, "lr": 0.2, "grad_norm": 2.0}])
    assert out == {"actor/loss": 2.0, "actor/tokens": 15.0, "actor/lr": 0.2, "actor/grad_norm": 2.0,
                   "actor/optimizer_steps": 2.0}
    critic = combine_update_metrics([{"vf_loss": 1.0, "seqs": 4}, {"vf_loss": 2.0, "seqs": 4}], prefix="critic/")
    assert critic == {"critic/vf_loss": 1.5, "critic/seqs": 8.0, "critic/optimizer_steps": 2.0}

"""The schedule, staleness and rollout-correction keys are checked at start-up, each error naming its key."""
from __future__ import annotations

import pytest

from rldispatch.config import ConfigError, load_config


@pytest.mark.parametrize("overrides, fragment", [
    (["trainer.mode=separate_async", "trainer.separate_async.rollout_ranks=0"], "trainer.separate_async.rollout_ranks"),
    (["trainer.mode=overlap"], "trainer.mode"),
    (["rollout.partial_rollout=true"], "rollout.partial_rollout"),
    (["trainer.mode=colocate_async", "rollout.partial_rollout_chunk=0"], "rollout.partial_rollout_chunk"),
    (["trainer.mode=colocate_async", "trainer.colocate_async.num_warmup_batches=-1"], "num_warmup_batches"),
    (["replay.max_off_policy_threshold=0"], "replay.max_off_policy_threshold"),
    (["algorithm.rollout_correction.bypass_mode=true"], "rollout.log_prob_mode=bypass"),
    (["algorithm.rollout_correction.rollout_is=token", "rollout.log_prob_mode=bypass"], "rollout_is"),
    (["algorithm.rollout_correction.rollout_is=tokens"], "rollout_is"),
    (["algorithm.rollout_correction.rollout_rs=seq_sum_k1", "algorithm.rollout_correction.rollout_rs_threshold=2"],
     "lower_upper"),
])
def test_refused_with_the_key_named(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, overrides)


def test_defaults_are_the_reference_systems():
    cfg = load_config(None, ["trainer.mode=colocate_async"])
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs, rc.rollout_rs_threshold, rc.bypass_mode) == \
        (None, 2.0, None, None, False)
    assert cfg.trainer.colocate_async.num_warmup_batches == 1 and cfg.replay.max_off_policy_threshold == 8
    assert cfg.replay.off_policy_strategy == "drop" and cfg.rollout.partial_rollout is None
    ok = load_config(None, ["algorithm.rollout_correction.rollout_is=sequence",
                            "algorithm.rollout_correction.rollout_rs=seq_mean_k3,token_k1",
                            "algorithm.rollout_correction.rollout_rs_threshold=0.01,0.5_2.0"])
    assert ok.algorithm.rollout_correction.enabled

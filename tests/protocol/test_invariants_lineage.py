"""Field lineage end to end: agent-loop outputs -> reward -> KL penalty -> GRPO -> write-back, invariants hold."""
from __future__ import annotations

import torch
from tensordict import TensorDict

from protocol.algos.advantage import compute_advantage, session_inputs_from_keys
from protocol.rollout.agent_loop.output import AgentLoopOutput
from protocol.invariants import check_invariants
from protocol.store.keys import new_uid, trajectory_key, trajectory_tag
from protocol.algos.kl import FixedKLController, apply_kl_penalty
from protocol.batch.nested import jagged_to_padded, nested_lengths, padded_to_jagged, to_nested
from protocol.rollout.postprocess import postprocess_group
from protocol.algos.reward import RewardInput, compute_rm_scores, make_reward_manager
from protocol.rollout.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _output(prompt: str, turns: list[tuple[str, int]]) -> AgentLoopOutput:
    """A trajectory whose response is made of (text, is_policy) turns."""
    ids, mask = [], []
    for text, policy in turns:
        t = TOK.encode(text)
        ids += t
        mask += [policy] * len(t)
    return AgentLoopOutput(prompt_ids=TOK.encode(prompt), response_ids=ids, response_mask=mask,
                           response_logprobs=[-0.5 * m for m in mask])


def test_lineage_keeps_every_invariant():
    batches = []
    answers = {}
    for prompt, answer in (("abc", "cba"), ("hello", "olleh")):
        uid = new_uid()
        answers[uid] = answer
        sessions = {
            0: [_output(prompt, [(answer, 1)])],                                   # right
            1: [_output(prompt, [("zz", 1), ("<obs>", 0)]), _output(prompt, [(answer[:-1], 1)])],  # 2 outputs
            2: [_output(prompt, [("x", 1), ("tool says", 0), (answer, 1)])],      # observation in the middle
        }
        batches.append(postprocess_group(uid, sessions, global_steps=4))
    keys = [k for b in batches for k in b.keys]
    tags = [t for b in batches for t in b.tags]
    td = torch.cat([b.fields for b in batches]) if len(batches) > 1 else batches[0].fields
    # one dispatch padding sample with its own uid
    pad_key = trajectory_key(new_uid(), 0, 0)
    keys.append(pad_key)
    tags.append(trajectory_tag(1, 2, global_steps=4, is_padding=True))
    pad_fields = TensorDict({
        "prompts": to_nested([torch.tensor([1])]), "responses": to_nested([torch.tensor([0, 0])]),
        "input_ids": to_nested([torch.tensor([1, 0, 0])]), "position_ids": to_nested([torch.arange(3)]),
        "response_mask": to_nested([torch.zeros(2, dtype=torch.long)]),
        "loss_mask": to_nested([torch.zeros(2, dtype=torch.long)]),
        "rollout_log_probs": to_nested([torch.zeros(2)])}, batch_size=[1])
    td = torch.cat([td, pad_fields])
    is_padding = torch.tensor([t["is_padding"] for t in tags])
    assert check_invariants(td, keys=keys, tags=tags) == []

    # reward: exact match of the policy tokens only (observations removed before decoding)
    mgr = make_reward_manager("naive", decode=TOK.decode, policy_tokens_only=True)
    items = [RewardInput(td["responses"][i], "exact_match", answers.get(k.split("_")[0]),
                         response_mask=td["response_mask"][i], is_padding=bool(is_padding[i]))
             for i, k in enumerate(keys)]
    scores = mgr(items).scores
    # per group: session 0 right; session 1 outputs "zz" and the truncated answer; session 2 "x" + answer
    assert scores.tolist() == [1.0, 0.0, 0.0, 0.0] * 2 + [0.0]
    rm, dropped = compute_rm_scores(scores, td["response_mask"], is_padding=is_padding, with_dropped=True)
    assert dropped == 0
    td["rm_scores"] = rm

    # algorithm stage on padded tensors, then back to jagged
    lengths = nested_lengths(td["response_mask"])
    mask = jagged_to_padded(td["response_mask"])
    old = jagged_to_padded(td["rollout_log_probs"])
    ref = old - 0.1 * mask
    rewards, metrics = apply_kl_penalty(jagged_to_padded(rm), old, ref, mask, FixedKLController(0.1), "kl",
                                        is_padding=is_padding)
    assert metrics["kl_penalty"] > 0
    adv, ret = compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, is_padding=is_padding,
                                 **session_inputs_from_keys(keys))
    td["token_level_scores"] = padded_to_jagged(jagged_to_padded(rm), lengths)
    td["token_level_rewards"] = padded_to_jagged(rewards, lengths)
    td["advantages"] = padded_to_jagged(adv, lengths)
    td["returns"] = padded_to_jagged(ret, lengths)
    td["old_log_probs"] = td["rollout_log_probs"]
    assert check_invariants(td, keys=keys, tags=tags) == []

    # both outputs of the two-output session share its advantage (from the final output), where they have policy
    k0, k1 = keys.index(keys[1]), keys.index(keys[2])
    a0, a1 = td["advantages"][k0], td["advantages"][k1]
    assert a0[td["response_mask"][k0].bool()].unique().numel() == 1
    assert torch.allclose(a0[0], a1[0])

    # a balanced reorder keeps (key, uid, tags)
    perm = torch.randperm(len(keys), generator=torch.Generator().manual_seed(0)).tolist()
    assert check_invariants(td[perm], keys=[keys[i] for i in perm], tags=[tags[i] for i in perm],
                            before=(keys, tags)) == []

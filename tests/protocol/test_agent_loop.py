"""Agent loops (single-turn, tool use), the generate adapter, tools, and running prompt groups into a store."""
from __future__ import annotations

import asyncio
import enum

import pytest
import torch
from hypothesis import given, settings, strategies as st

from protocol.rollout.agent_loop import (
    AgentLoop, AgentLoopOutput, AgentLoopOutputError, GenerateError, SingleTurnAgentLoop, ToolAgentLoop, ToolCall,
    ToolError, ToolRegistry, build_agent_loop, builtin_tools, calculator, call_generate, format_tool_call,
    get_agent_loop_class, known_agent_loops, observation_ids, parse_tool_calls, register_agent_loop,
    register_prompts, run_group, run_groups,
)
from protocol.store.keys import IllegalTransitionError, new_uid, parse_trajectory_key
from protocol.store import LocalStore
from protocol.rollout.tokenizer import CharTokenizer

TOK = CharTokenizer()
EOS = TOK.eos_token_id


def run(coro):
    return asyncio.run(coro)


# ----------------------------------------------------------------------------------------- AgentLoopOutput
def test_output_converts_and_measures():
    o = AgentLoopOutput([1, 2], [3, 4, 5], [1, 0, 1], [-0.1, 0.0, -0.2], reward_score=torch.tensor(0.5))
    assert o.prompt_ids.dtype == torch.int64 and o.response_logprobs.dtype == torch.float32
    assert (o.prompt_len, o.response_len, o.seq_len, o.policy_len) == (2, 3, 5, 2)
    assert o.reward_score == 0.5 and isinstance(o.reward_score, float)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(response_mask=[1, 1]), "response_mask has 2"),
    (dict(response_logprobs=[0.0]), "response_logprobs has 1"),
    (dict(prompt_ids=[]), "prompt_len >= 1"),
    (dict(response_mask=[1, 2, 1]), "only 0 and 1"),
    (dict(response_ids=[1.5, 2, 3]), "response_ids must hold ints"),
    (dict(response_ids=torch.ones(3)), "response_ids must hold integers"),
    (dict(prompt_ids=torch.ones(1, 2, dtype=torch.long)), "prompt_ids must be 1-D"),
    (dict(reward_score="high"), "reward_score"),
    (dict(reward_score=float("nan")), "finite"),
    (dict(num_turns=-1), "num_turns"),
    (dict(extra_fields=[]), "extra_fields"),
    (dict(multi_modal_inputs={"x": 1}), "multi_modal_inputs"),
])
def test_output_validation_names_the_field(kwargs, fragment):
    base = dict(prompt_ids=[1], response_ids=[3, 4, 5], response_mask=[1, 0, 1])
    with pytest.raises(AgentLoopOutputError, match=fragment):
        AgentLoopOutput(**{**base, **kwargs})


# ----------------------------------------------------------------------------------------- generate adapter
def test_call_generate_sync_async_and_errors():
    def sync_gen(ids, sp):
        return torch.tensor([7, 8]), torch.tensor([-1.0, -2.0])

    async def async_gen(ids, sp):
        await asyncio.sleep(0)
        return [7, 8], None

    assert run(call_generate(sync_gen, [1], {})) == ([7, 8], [-1.0, -2.0])
    assert run(call_generate(async_gen, [1], {})) == ([7, 8], None)
    with pytest.raises(GenerateError, match="2 token ids but 1 log-probs"):
        run(call_generate(lambda i, s: ([1, 2], [0.0]), [1], {}))
    with pytest.raises(GenerateError, match="must return"):
        run(call_generate(lambda i, s: [1, 2, 3], [1], {}))
    with pytest.raises(GenerateError, match="ints"):
        run(call_generate(lambda i, s: (["a"], None), [1], {}))


# ----------------------------------------------------------------------------------------- single turn
def test_single_turn_templates_messages_and_caps_tokens():
    seen = {}

    def gen(ids, sp):
        seen.update(ids=ids, sp=sp)
        return [10, 11, EOS], [-0.5, -0.5, -0.1]

    loop = SingleTurnAgentLoop(gen, TOK, max_response_length=8)
    msgs = [{"role": "user", "content": "hi"}]
    (out,) = run(loop.run(msgs, {"temperature": 1.0, "max_tokens": 100}))
    assert seen["ids"] == TOK.apply_chat_template(msgs) and seen["sp"] == {"temperature": 1.0, "max_tokens": 8}
    assert out.response_ids.tolist() == [10, 11, EOS] and out.response_mask.tolist() == [1, 1, 1]
    assert out.num_turns == 2 and out.extra_fields["truncated"] is False
    (out,) = run(loop.run([4, 5], {"max_tokens": 3}))
    assert seen["ids"] == [4, 5] and seen["sp"]["max_tokens"] == 3


def test_prompt_template_is_reused_for_equal_messages_only():
    """The sessions of a group share their prompt: templated once; messages edited in place are templated again."""
    calls = []

    class Counting(CharTokenizer):
        def apply_chat_template(self, messages, **kw):
            calls.append(1)
            return super().apply_chat_template(messages, **kw)

    tok = Counting()
    loop = SingleTurnAgentLoop(lambda i, s: ([7], None), tok)
    msgs = [{"role": "user", "content": "hi"}]
    first = loop.prompt_to_ids(msgs)
    first.append(99)  # the caller owns what it gets
    assert loop.prompt_to_ids(msgs) == tok.apply_chat_template(msgs) and len(calls) == 2
    msgs[0]["content"] = "ho"
    assert loop.prompt_to_ids(msgs) == TOK.apply_chat_template(msgs) and len(calls) == 3
    assert loop.prompt_to_ids([{"role": "user", "content": "ho"}]) == TOK.apply_chat_template(msgs)
    assert len(calls) == 3


def test_output_fast_checks_keep_the_errors():
    """The one-pass type checks still refuse bools and floats among ids and accept int subclasses."""
    import enum

    class Tok(enum.IntEnum):
        A = 3

    out = AgentLoopOutput([Tok.A], (4, 5), [1, 0], (-0.5, -1))
    assert out.prompt_ids.tolist() == [3] and out.response_logprobs.tolist() == [-0.5, -1.0]
    with pytest.raises(AgentLoopOutputError, match="must hold ints"):
        AgentLoopOutput([1, True], [4], [1])
    with pytest.raises(AgentLoopOutputError, match="only 0 and 1"):
        AgentLoopOutput([1], [4, 5], [1, 3])
    with pytest.raises(AgentLoopOutputError, match="outside int64"):
        AgentLoopOutput([2 ** 70], [4], [1])
    with pytest.raises(GenerateError, match="ints"):
        run(call_generate(lambda i, s: ([1, 2.0], None), [1], {}))
    assert run(call_generate(lambda i, s: ([1], (x for x in [-1])), [1], {})) == ([1], [-1.0])


def test_single_turn_truncates_an_overlong_generator_and_reports_it():
    loop = SingleTurnAgentLoop(lambda i, s: (list(range(20, 32)), [-1.0] * 12), TOK, max_response_length=5)
    (out,) = run(loop.run([1]))
    assert out.response_ids.tolist() == [20, 21, 22, 23, 24] and out.response_logprobs.numel() == 5
    assert out.extra_fields["truncated"] and out.extra_fields["truncated_tokens"] == 7
    assert out.extra_fields["truncated_kind"] == "generation"


def test_agent_loop_argument_errors():
    with pytest.raises(TypeError, match="callable"):
        SingleTurnAgentLoop(3, TOK)
    with pytest.raises(ValueError, match="max_response_length"):
        SingleTurnAgentLoop(lambda i, s: ([], None), TOK, max_response_length=0)
    loop = SingleTurnAgentLoop(lambda i, s: ([1], None), None)
    with pytest.raises(ValueError, match="no tokenizer"):
        run(loop.run([{"role": "user", "content": "x"}]))
    with pytest.raises(ValueError, match="empty"):
        run(loop.run([]))
    with pytest.raises(TypeError, match="token ids or a list of chat messages"):
        run(loop.run("text"))
    with pytest.raises(ValueError, match="max_tokens"):
        run(loop.run([1], {"max_tokens": 0}))
    with pytest.raises(ValueError, match="tokenizer"):
        ToolAgentLoop(lambda i, s: ([], None), None)
    with pytest.raises(ValueError, match="max_turns"):
        ToolAgentLoop(lambda i, s: ([], None), TOK, max_turns=0)


def test_registry():
    assert {"single_turn", "tool"} <= set(known_agent_loops())
    assert get_agent_loop_class("tool") is ToolAgentLoop
    loop = build_agent_loop("single_turn", lambda i, s: ([1], None), TOK, max_response_length=4)
    assert isinstance(loop, SingleTurnAgentLoop) and loop.max_response_length == 4
    with pytest.raises(ValueError, match="nope.*single_turn"):
        get_agent_loop_class("nope")
    with pytest.raises(TypeError):
        register_agent_loop("x")(int)
    with pytest.raises(ValueError, match="already registered"):
        register_agent_loop("tool")(SingleTurnAgentLoop)


# ----------------------------------------------------------------------------------------- tools
@settings(max_examples=50, deadline=None)
@given(name=st.text(min_size=1, max_size=10), args=st.dictionaries(st.text(max_size=5),
                                                                   st.integers() | st.text(max_size=5), max_size=3))
def test_tool_call_format_round_trip(name, args):
    text = "think " + format_tool_call(name, args) + " more " + format_tool_call("b", {})
    calls, errors = parse_tool_calls(text)
    assert errors == [] and calls == [ToolCall(name, args), ToolCall("b", {})]


def test_parse_tool_call_errors_and_calculator():
    calls, errors = parse_tool_calls('<tool_call>{bad</tool_call><tool_call>[1]</tool_call>'
                                     '<tool_call>{"name": "a", "arguments": 3}</tool_call>')
    assert calls == [] and len(errors) == 3
    assert "not valid JSON" in errors[0] and "string 'name'" in errors[1] and "'arguments'" in errors[2]
    assert parse_tool_calls("no call here") == ([], [])
    assert calculator("3*(4+5)") == "27" and calculator("7/2") == "3.5" and calculator("-2**3") == "-8"
    for bad in ("__import__('os')", "a+1", "2**1000", "x" * 300):
        with pytest.raises(ValueError):
            calculator(bad)


def test_tool_registry():
    reg = ToolRegistry()

    @reg.register(description="echo")
    async def echo(text: str, prefix: str = "") -> str:
        return prefix + text

    reg.register(lambda: {"a": 1}, name="obj")
    assert reg.names() == ["echo", "obj"] and "echo" in reg and len(reg) == 2
    assert reg.describe()["echo"] == "echo"
    assert run(reg.call(ToolCall("echo", {"text": "x"}), {"prefix": ">"})) == ">x"
    assert run(reg.call(ToolCall("obj", {}))) == '{"a": 1}'
    with pytest.raises(ToolError, match="unknown tool 'zz'"):
        run(reg.call(ToolCall("zz", {})))
    with pytest.raises(ToolError, match="prefix"):
        run(reg.call(ToolCall("echo", {"text": "x", "prefix": "!"}), {"prefix": ">"}))
    with pytest.raises(ToolError, match="TypeError"):
        run(reg.call(ToolCall("echo", {"nope": 1})))
    with pytest.raises(ValueError, match="already registered"):
        reg.register(lambda: 1, name="echo")
    assert builtin_tools().names() == ["calculator"]


# ----------------------------------------------------------------------------------------- tool agent loop
class Script:
    """A generator that replays a fixed list of assistant turns (text + eos) with log-prob -0.25 per token."""

    def __init__(self, turns: list[str], eos: bool = True):
        self.turns, self.eos, self.calls, self.outputs = list(turns), eos, [], []

    def __call__(self, ids, sp):
        self.calls.append((list(ids), dict(sp)))
        text = self.turns.pop(0) if self.turns else "done"
        toks = TOK.encode(text) + ([EOS] if self.eos else [])
        toks = toks[: sp["max_tokens"]]
        self.outputs.append(toks)
        return toks, [-0.25] * len(toks)


def test_tool_loop_masks_observations_and_feeds_them_back():
    call = format_tool_call("calculator", {"expression": "6*7"})
    gen = Script([call, "It is 42"])
    loop = ToolAgentLoop(gen, TOK, max_response_length=500, max_turns=3)
    prompt = [{"role": "user", "content": "6*7?"}]
    (out,) = run(loop.run(prompt, {"max_tokens": 400}))
    obs = observation_ids(TOK, [{"role": "tool", "content": "42"}])
    first = TOK.encode(call) + [EOS]
    second = TOK.encode("It is 42") + [EOS]
    assert out.response_ids.tolist() == first + obs + second
    assert out.response_mask.tolist() == [1] * len(first) + [0] * len(obs) + [1] * len(second)
    assert out.response_logprobs.tolist() == [-0.25] * len(first) + [0.0] * len(obs) + [-0.25] * len(second)
    # the second generation sees prompt + first turn + observation, with the remaining budget
    assert gen.calls[1][0] == TOK.apply_chat_template(prompt) + first + obs
    assert gen.calls[1][1]["max_tokens"] == min(400, 500 - len(first) - len(obs))
    assert out.extra_fields["stop_reason"] == "no_tool_call" and out.extra_fields["tool_calls"] == 1
    assert out.num_turns == 4  # user, assistant, tool, assistant


def test_tool_loop_errors_become_observations():
    gen = Script([format_tool_call("nope", {}), "<tool_call>{oops</tool_call>",
                  format_tool_call("calculator", {"expression": "1/0"}), "ok"])
    (out,) = run(ToolAgentLoop(gen, TOK, max_response_length=2000, max_turns=5).run([1, 2]))
    errs = out.extra_fields["tool_errors"]
    assert len(errs) == 3 and "unknown tool 'nope'" in errs[0] and "not valid JSON" in errs[1] and \
        "ZeroDivisionError" in errs[2]
    text = TOK.decode(out.response_ids[out.response_mask == 0])
    assert "Error: unknown tool 'nope'" in text and "ZeroDivisionError" in text


def test_tool_loop_stops_at_max_turns_and_unfinished_turns():
    call = format_tool_call("calculator", {"expression": "1+1"})
    (out,) = run(ToolAgentLoop(Script([call] * 5), TOK, max_response_length=3000, max_turns=2).run([1]))
    assert out.extra_fields["stop_reason"] == "max_turns" and out.extra_fields["assistant_turns"] == 2
    assert out.response_mask[-1].item() == 1  # no observation after the last allowed turn
    (out,) = run(ToolAgentLoop(Script([call], eos=False), TOK, max_response_length=3000).run([1]))
    assert out.extra_fields["stop_reason"] == "unfinished_turn"


def test_tool_loop_tools_kwargs_parallel_limit_and_long_results():
    reg = ToolRegistry()
    reg.register(lambda key, answer: "yes" if key == answer else "no", name="check")
    reg.register(lambda: "z" * 50, name="long")
    two = format_tool_call("check", {"key": "a"}) + format_tool_call("check", {"key": "b"})
    gen = Script([two, format_tool_call("long"), "fin"])
    loop = ToolAgentLoop(gen, TOK, max_response_length=3000, tools=reg, max_parallel_calls=1,
                         max_tool_response_length=10, max_turns=4)
    (out,) = run(loop.run([1], tools_kwargs={"check": {"answer": "a"}}))
    obs_text = TOK.decode(out.response_ids[out.response_mask == 0], skip_special=True)
    assert "yes" in obs_text and "skipped" in obs_text and "z" * 10 in obs_text and "z" * 11 not in obs_text
    assert out.extra_fields["tool_response_truncated_chars"] == 40
    with pytest.raises(TypeError, match="tools_kwargs"):
        run(loop.run([1], tools_kwargs=[1]))


@settings(max_examples=40, deadline=None)
@given(limit=st.integers(1, 200), turns=st.lists(st.sampled_from(["a", "bb", "c" * 30, "call"]), max_size=5),
       per_turn=st.integers(1, 60))
def test_tool_loop_truncation_keeps_mask_aligned(limit, turns, per_turn):
    """Response never exceeds the limit; the mask-1 tokens are exactly a prefix of what the policy generated."""
    call = format_tool_call("calculator", {"expression": "2+2"})
    gen = Script([call if t == "call" else t for t in turns] + ["end"])
    (out,) = run(ToolAgentLoop(gen, TOK, max_response_length=limit, max_turns=4).run([1], {"max_tokens": per_turn}))
    n = out.response_len
    assert n <= limit and out.response_mask.numel() == n and out.response_logprobs.numel() == n
    generated = [t for toks in gen.outputs for t in toks]
    policy = out.response_ids[out.response_mask == 1].tolist()
    assert policy == generated[: len(policy)]
    if not out.extra_fields["truncated"]:
        assert policy == generated
    else:
        assert n == limit
    lp = out.response_logprobs
    assert torch.all((lp == -0.25) == (out.response_mask == 1))
    assert out.extra_fields["truncated"] == (out.extra_fields["truncated_tokens"] > 0)
    for _, sp in gen.calls:
        assert 1 <= sp["max_tokens"] <= min(per_turn, limit)


def test_tool_loop_async_generate():
    async def agen(ids, sp):
        await asyncio.sleep(0)
        return TOK.encode("plain") + [EOS], None

    (out,) = run(ToolAgentLoop(agen, TOK, max_response_length=50).run([1]))
    assert out.response_logprobs is None and out.policy_len == 6


# ----------------------------------------------------------------------------------------- groups into the store
class CountingStore(LocalStore):
    """A real LocalStore that also records every batch put (keys, whether it carried fields)."""

    def __init__(self):
        super().__init__()
        self.puts = []

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None, overwrite=False):
        self.puts.append((list(keys), fields is not None, [dict(t) for t in tags] if tags else None))
        return super().kv_batch_put(keys, partition_id, fields, tags, overwrite)


def _status(store, uid, pid="train"):
    return store.kv_batch_get_tags([uid], pid)[0]["status"]


def test_run_group_writes_one_batch_then_finished():
    store = CountingStore()
    uid = new_uid()
    register_prompts(store, [uid], global_steps=3)
    assert _status(store, uid) == "pending"
    loop = SingleTurnAgentLoop(lambda i, s: ([5, 6, EOS], [-1.0] * 3), TOK, 8)
    meta = run(run_group(store, uid, [1, 2, 3], 4, loop, global_steps=3))
    assert meta.extra_info["status"] == "finished" and len(meta) == 4
    assert sorted(parse_trajectory_key(k)[1] for k in meta.keys) == [0, 1, 2, 3]
    field_puts = [p for p in store.puts if p[1]]
    assert len(field_puts) == 1 and sorted(field_puts[0][0]) == sorted(meta.keys)
    statuses = [p[2][0]["status"] for p in store.puts if p[0] == [uid]]
    assert statuses == ["pending", "running", "finished"]
    assert store.puts.index(field_puts[0]) < len(store.puts) - 1  # data before the final status
    tag = store.kv_batch_get_tags([uid], "train")[0]
    assert tag["global_steps"] == 3 and tag["num_trajectories"] == 4 and tag["num_failed_sessions"] == 0
    td = store.kv_batch_get(meta.keys, "train", ["input_ids"])
    assert td["input_ids"][0].tolist() == [1, 2, 3, 5, 6, EOS]
    with pytest.raises(IllegalTransitionError, match="'finished' -> 'running'"):
        run(run_group(store, uid, [1], 1, loop, 3))


def test_run_group_failure_keeps_successful_sessions_and_waits_for_all():
    store = CountingStore()
    uid = new_uid()
    seen_status_while_slow = []

    class Flaky(AgentLoop):
        async def run(self, prompt, sampling_params=None, session_id=0, **kw):
            if session_id == 1:
                raise RuntimeError("tool server down")
            if session_id == 2:
                await asyncio.sleep(0.05)  # the failure of session 1 is known by now
                seen_status_while_slow.append(_status(store, uid))
            return [AgentLoopOutput(prompt, [7, 7], [1, 1]), AgentLoopOutput(prompt, [8], [1])]

    meta = run(run_group(store, uid, [1, 2], 3, Flaky(lambda i, s: None), global_steps=0))
    assert seen_status_while_slow == ["running"]
    assert meta.extra_info["status"] == "failure" and meta.extra_info["num_failed_sessions"] == 1
    assert "tool server down" in meta.extra_info["errors"][0]
    assert sorted(meta.keys) == sorted(f"{uid}_{s}_{i}" for s in (0, 2) for i in (0, 1))
    tag = store.kv_batch_get_tags([uid], "train")[0]
    assert tag["status"] == "failure" and tag["num_errors"] == 1 and tag["num_trajectories"] == 4
    assert len([p for p in store.puts if p[1]]) == 1


def test_run_group_all_failed_writes_no_data():
    store = LocalStore()
    uid = new_uid()

    class Broken(AgentLoop):
        async def run(self, prompt, sampling_params=None, **kw):
            raise ValueError("bad")

    meta = run(run_group(store, uid, [1], 2, Broken(lambda i, s: None), 0))
    assert len(meta) == 0 and meta.extra_info["status"] == "failure"
    assert list(store.kv_list("train")["train"]) == [uid]


def test_run_group_bad_session_return_is_a_session_failure():
    class Empty(AgentLoop):
        async def run(self, prompt, sampling_params=None, **kw):
            return []

    store = LocalStore()
    meta = run(run_group(store, new_uid(), [1], 1, Empty(lambda i, s: None), 0))
    assert meta.extra_info["status"] == "failure" and "non-empty list" in meta.extra_info["errors"][0]


def test_run_group_cleared_while_running_writes_nothing_late():
    store = LocalStore()
    uid = new_uid()

    class Slow(AgentLoop):
        async def run(self, prompt, sampling_params=None, **kw):
            await asyncio.sleep(0.02)
            return [AgentLoopOutput(prompt, [3], [1])]

    async def main():
        task = asyncio.create_task(run_group(store, uid, [1], 2, Slow(lambda i, s: None), 0))
        await asyncio.sleep(0.005)
        store.kv_clear([uid], "train")
        return await task

    meta = run(main())
    assert meta.extra_info["status"] == "cleared" and meta.extra_info["dropped_trajectories"] == 2
    assert store.stats()["keys"] == 0 and store.stats()["late_writes_refused"] >= 1


def test_run_group_cancelled_marks_failure_after_sessions_settle():
    store = LocalStore()
    uid = new_uid()
    settled = []

    class Hang(AgentLoop):
        async def run(self, prompt, sampling_params=None, **kw):
            try:
                await asyncio.sleep(10)
            finally:
                settled.append(True)

    async def main():
        task = asyncio.create_task(run_group(store, uid, [1], 3, Hang(lambda i, s: None), 0))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert settled == [True] * 3 and _status(store, uid) == "failure"


def test_run_group_argument_errors():
    loop = SingleTurnAgentLoop(lambda i, s: ([1], None), TOK, 4)
    with pytest.raises(ValueError, match="rollout.n"):
        run(run_group(LocalStore(), new_uid(), [1], 0, loop, 0))
    with pytest.raises(TypeError, match="AgentLoop"):
        run(run_group(LocalStore(), new_uid(), [1], 1, object(), 0))
    with pytest.raises(ValueError, match="'_'"):
        run(run_group(LocalStore(), "a_b", [1], 1, loop, 0))
    store = LocalStore()
    uid = new_uid()
    register_prompts(store, [uid], 0)
    with pytest.raises(ValueError, match="already in partition"):
        register_prompts(store, [uid], 0)
    with pytest.raises(ValueError, match="unique"):
        register_prompts(store, ["a", "a"], 0)
    with pytest.raises(ValueError, match="2 uids but 1 prompts"):
        run(run_groups(store, ["a", "b"], [[1]], 1, loop, 0))


def test_run_groups_runs_every_session_concurrently():
    """All sessions of all groups are in flight together, so an async generator can batch them."""
    in_flight, peak = 0, 0

    async def agen(ids, sp):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return [ids[-1], EOS], [-0.5, -0.5]

    store = LocalStore()
    uids = [new_uid() for _ in range(3)]
    register_prompts(store, uids, 1, "val")
    loop = SingleTurnAgentLoop(agen, TOK, 4)
    metas = run(run_groups(store, uids, [[1, 10], [1, 11], [1, 12]], 4, loop, 1, "val",
                           row_kwargs=[{"tools_kwargs": {}}] * 3))
    assert peak == 12 and [m.extra_info["status"] for m in metas] == ["finished"] * 3
    got = store.kv_batch_get(metas[2].keys, "val", ["responses", "rollout_log_probs"])
    assert got["responses"][:, 0].tolist() == [12] * 4


class _Bit(enum.IntEnum):
    ONE = 1


_ID_ITEMS = st.one_of(st.integers(0, 3), st.integers(-2**64, 2**64), st.booleans(), st.floats(0, 2),
                      st.just(_Bit.ONE))


def _built(prompt, response, mask):
    try:
        out = AgentLoopOutput(prompt_ids=prompt, response_ids=response, response_mask=mask)
    except AgentLoopOutputError as exc:
        return str(exc)
    return [(t.dtype, t.device.type, t.tolist()) for t in (out.prompt_ids, out.response_ids, out.response_mask)]


@settings(max_examples=200, deadline=None)
@given(st.lists(_ID_ITEMS, max_size=5), st.lists(_ID_ITEMS, max_size=5), st.lists(_ID_ITEMS, max_size=5))
def test_list_fast_path_equals_per_field_path(prompt, response, mask):
    """Lists take the one-conversion path, tuples the per-field one: same tensors, or the same error (bools,
    floats, ints outside int64, masks not 0/1, unequal lengths); int subclasses become plain ints."""
    assert _built(prompt, response, mask) == _built(tuple(prompt), tuple(response), tuple(mask))
    if len(response) == len(mask) and len(prompt) >= 1:
        fast = _built(prompt, response, mask)
        if not isinstance(fast, str):
            assert fast[2][2] == [int(m) for m in mask]


def test_list_fields_are_int64_views_that_keep_their_own_values():
    out = AgentLoopOutput(prompt_ids=[5, 6], response_ids=[7, 8, 9], response_mask=[1, 0, 1])
    assert [t.tolist() for t in (out.prompt_ids, out.response_ids, out.response_mask)] == [[5, 6], [7, 8, 9],
                                                                                             [1, 0, 1]]
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in (out.prompt_ids, out.response_ids,
                                                                       out.response_mask))
    out.response_mask[0] = 0  # one field written in place leaves the others as they were
    assert out.response_ids.tolist() == [7, 8, 9] and out.prompt_ids.tolist() == [5, 6]

"""Rollout sessions: the AgentLoop interface, the built-in single-turn and tool loops, and running prompt groups."""
from __future__ import annotations

from protocol.rollout.agent_loop.base import (
    AgentLoop, GenerateError, GenerateFn, build_agent_loop, call_generate, get_agent_loop_class, known_agent_loops,
    register_agent_loop,
)
from protocol.rollout.agent_loop.group import (
    MAX_ERRORS_IN_TAG, PromptInputs, register_prompts, run_group, run_groups,
)
from protocol.rollout.agent_loop.output import AgentLoopOutput, AgentLoopOutputError
from protocol.rollout.agent_loop.single_turn import SingleTurnAgentLoop
from protocol.rollout.agent_loop.tool_agent import ToolAgentLoop, observation_ids
from protocol.rollout.agent_loop.tools import (
    TOOL_CALL_END, TOOL_CALL_START, ToolCall, ToolError, ToolRegistry, builtin_tools, calculator,
    format_tool_call, parse_tool_calls,
)

__all__ = [
    "AgentLoop", "AgentLoopOutput", "AgentLoopOutputError", "GenerateError", "GenerateFn", "PromptInputs",
    "SingleTurnAgentLoop",
    "ToolAgentLoop", "ToolCall", "ToolError", "ToolRegistry", "TOOL_CALL_START",
    "TOOL_CALL_END", "MAX_ERRORS_IN_TAG", "build_agent_loop", "builtin_tools", "calculator", "call_generate",
    "format_tool_call", "get_agent_loop_class", "known_agent_loops", "observation_ids", "parse_tool_calls",
    "register_agent_loop", "register_prompts", "run_group", "run_groups",
]

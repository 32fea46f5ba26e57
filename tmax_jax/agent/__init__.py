"""The terminal agent: harnesses (TMAX's bash tool, mini-swe, OpenHands tools, Terminus-2), the tolerant
tool-call parser, the context policy, the episode loop."""

from tmax_jax.agent.harness import HARNESSES, Harness, Step, get_harness
from tmax_jax.agent.protocol import (
    BASH_TOOL,
    SUBMIT_MARKER,
    FormatError,
    ParsedReply,
    ToolCall,
    format_tool_result,
    parse_reply,
    parse_tool_calls,
    render_function_call,
    render_tool_call,
)
from tmax_jax.agent.terminus import TerminusCommand, TerminusReply, parse_terminus_reply

__all__ = [
    "BASH_TOOL",
    "HARNESSES",
    "SUBMIT_MARKER",
    "FormatError",
    "Harness",
    "ParsedReply",
    "Step",
    "TerminusCommand",
    "TerminusReply",
    "ToolCall",
    "format_tool_result",
    "get_harness",
    "parse_reply",
    "parse_terminus_reply",
    "parse_tool_calls",
    "render_function_call",
    "render_tool_call",
]

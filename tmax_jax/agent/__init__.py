"""The terminal agent: tool-call protocol, harnesses (bash tool, Terminus-2 JSON), the episode loop."""

from tmax_jax.agent.protocol import (
    BASH_TOOL,
    SUBMIT_MARKER,
    FormatError,
    ToolCall,
    format_tool_result,
    parse_tool_calls,
    render_tool_call,
)
from tmax_jax.agent.terminus import TerminusCommand, TerminusReply, parse_terminus_reply

__all__ = [
    "BASH_TOOL",
    "SUBMIT_MARKER",
    "FormatError",
    "TerminusCommand",
    "TerminusReply",
    "ToolCall",
    "format_tool_result",
    "parse_terminus_reply",
    "parse_tool_calls",
    "render_tool_call",
]

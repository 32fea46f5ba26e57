"""The rollout engine: JetStream's Engine interface for our model, sampling, continuous batching."""

from tmax_jax.engine.api import generate
from tmax_jax.engine.engine import DecodeState, Engine, Prefix
from tmax_jax.engine.engine_api import EngineAPI, ResultTokens, SlotData
from tmax_jax.engine.orchestrator import (
    Completion,
    EngineBusy,
    Orchestrator,
    Request,
    RequestCancelled,
    RequestHandle,
    TokenEvent,
)
from tmax_jax.engine.sampling import SamplingParams
from tmax_jax.engine.session import EnginePolicy

__all__ = [
    "Completion",
    "DecodeState",
    "Engine",
    "EngineAPI",
    "EngineBusy",
    "EnginePolicy",
    "Orchestrator",
    "Prefix",
    "Request",
    "RequestCancelled",
    "RequestHandle",
    "ResultTokens",
    "SamplingParams",
    "SlotData",
    "TokenEvent",
    "generate",
]

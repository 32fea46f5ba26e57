"""JetStream's Engine interface (AI-Hypercomputer/JetStream ``engine_api``), restated for tmax-jax.

The method names, keyword arguments and return types follow JetStream's so its orchestrator can
drive :class:`tmax_jax.engine.Engine`; tmax-jax's own orchestrator uses the same calls.
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import numpy as np
from flax import struct

Params = Any
Prefix = Any
DecodeState = Any


@struct.dataclass
class SlotData:
    """One slot's view of a :class:`ResultTokens`: rows are the slot's samples."""

    tokens: jax.Array | np.ndarray
    valid: jax.Array | np.ndarray
    lengths: jax.Array | np.ndarray
    log_prob: jax.Array | np.ndarray | None = None


@struct.dataclass
class ResultTokens:
    """Tokens of one prefill or generate step for every slot, in one array for a single host copy.

    ``data`` is int32 ``[slots * samples_per_slot, 3]``: columns ``tokens_idx`` hold the token,
    ``valid_idx`` whether the slot produced a real token this step, ``length_idx`` how many tokens
    the slot has generated so far (this one included). ``log_prob`` (float32, same rows, one
    column) is tmax-jax's addition: the token's logprob under the sampling distribution.
    """

    data: jax.Array | np.ndarray
    tokens_idx: tuple[int, int] = struct.field(pytree_node=False)
    valid_idx: tuple[int, int] = struct.field(pytree_node=False)
    length_idx: tuple[int, int] = struct.field(pytree_node=False)
    samples_per_slot: int = struct.field(pytree_node=False)
    log_prob: jax.Array | np.ndarray | None = None

    def copy_to_host_async(self) -> None:
        for x in (self.data, self.log_prob):
            if isinstance(x, jax.Array):
                x.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        return self.replace(
            data=np.asarray(self.data),
            log_prob=None if self.log_prob is None else np.asarray(self.log_prob),
        )

    def get_result_at_slot(self, slot: int) -> SlotData:
        lo, hi = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
        return SlotData(
            tokens=self.data[lo:hi, self.tokens_idx[0] : self.tokens_idx[1]],
            valid=self.data[lo:hi, self.valid_idx[0] : self.valid_idx[1]],
            lengths=self.data[lo:hi, self.length_idx[0] : self.length_idx[1]][:, 0],
            log_prob=None if self.log_prob is None else self.log_prob[lo:hi],
        )


class EngineAPI(abc.ABC):
    """The accelerator-side calls an outer continuous-batching loop makes."""

    @abc.abstractmethod
    def prefill(
        self,
        *,
        params: Params,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array,
        true_length: int,
        sampler: Any | None = None,
    ) -> tuple[Prefix, ResultTokens]:
        """State for ``padded_tokens[:true_length]`` appended to ``existing_prefix``, and its first token."""

    @abc.abstractmethod
    def generate(
        self, params: Params, decode_state: DecodeState, sampler: Any | None = None
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot."""

    @abc.abstractmethod
    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Place a prefilled request into decode ``slot``."""

    def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: list[int]) -> DecodeState:
        """Place one prefix into several slots (``samples_per_slot``-style fan-out)."""
        for slot in slots:
            decode_state = self.insert(prefix, decode_state, slot)
        return decode_state

    def free_resource(self, slot: int) -> Any:
        """Release what a finished slot holds (nothing for dense caches)."""
        return None

    @abc.abstractmethod
    def load_params(self, *args, **kwargs) -> Params:
        """The parameters the other calls take."""

    @abc.abstractmethod
    def get_prefix_destination_sharding(self) -> Any:
        """Shardings a prefix must have to be inserted (for disaggregated prefill/decode)."""

    @abc.abstractmethod
    def get_tokenizer(self) -> Any:
        """What a tokenizer for this engine is built from."""

    def build_tokenizer(self, metadata: Any) -> Any:
        return metadata

    @abc.abstractmethod
    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """An empty decode state with every slot free."""

    @property
    @abc.abstractmethod
    def max_concurrent_decodes(self) -> int: ...

    @property
    @abc.abstractmethod
    def samples_per_slot(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_prefill_length(self) -> int: ...

    @property
    @abc.abstractmethod
    def mesh(self) -> jax.sharding.Mesh: ...

    @property
    def colocated_cpus(self) -> list[Any] | None:
        return None

"""SFT warm start: next-token NLL on the policy tokens of demonstration trajectories.

It reuses ``TrainStep`` (mesh, shardings, accumulation, AdamW) with the policy loss replaced by the
negative log-likelihood of the masked tokens, normalised by their count.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from tmax_jax.rl.logprobs import token_logprobs
from tmax_jax.rl.train_step import TrainStep


class SFTStep(TrainStep):
    def _micro_loss(self, params, mb, normalizer):
        model = nnx.merge(self.graphdef, params, self.rest)
        hidden_BxTxD = model.hidden_states(
            mb["input_ids"], positions=mb["positions"], segment_ids=mb["segment_ids"]
        )
        # Temperature 1: SFT fits the model's own distribution, whatever the rollout temperature.
        logprobs_BxT = token_logprobs(
            hidden_BxTxD, model.lm_head_weight(), mb["targets"], chunk_size=self.cfg.loss.logprob_chunk
        )
        mask_BxT = mb["response_mask"].astype(jnp.float32)
        nll_sum = -(logprobs_BxT * mask_BxT).sum()
        zero = jnp.zeros((), jnp.float32)
        stats = {
            "tokens": mask_BxT.sum(),
            "ratio_sum": (jnp.exp(logprobs_BxT) * mask_BxT).sum(),  # mean token probability, reported
            "max_abs_logprob_diff": zero,
            "masked": zero,
            "masked_pos_adv": zero,
            "masked_neg_adv": zero,
        }
        return nll_sum / normalizer, stats

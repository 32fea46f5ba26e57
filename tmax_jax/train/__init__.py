"""The asynchronous RL loop: rollout workers, a bounded-staleness queue, the DPPO trainer, run management."""

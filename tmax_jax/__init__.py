"""tmax-jax: a JAX-native reimplementation of the TMAX recipe for RL on terminal agents."""

__version__ = "0.1.0"

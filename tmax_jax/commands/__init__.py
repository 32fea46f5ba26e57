"""Sub-commands of the ``tmax-jax`` CLI; see tmax_jax/cli.py for the registry."""

import sys

from tmax_jax.cli import main

sys.exit(main())

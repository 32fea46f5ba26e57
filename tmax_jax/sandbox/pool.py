"""placeholder, replaced below"""


class PoolMetrics: ...


class SandboxPool: ...

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import RankPool, close_all  # noqa: E402

_pools = {}


@pytest.fixture(scope="session")
def pools():
    """pools(world_size, backend="railcc", **env) -> a live RankPool, reused across tests."""

    def get(world_size, backend="railcc", **env):
        key = (world_size, backend, tuple(sorted(env.items())))
        pool = _pools.get(key)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.kill()
            pool = RankPool(world_size, backend=backend, env=env)
            _pools[key] = pool
        return pool

    yield get
    close_all(list(_pools.values()))
    _pools.clear()

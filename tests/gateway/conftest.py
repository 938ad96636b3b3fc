import pytest

from tests.support.redis import RedisServer


@pytest.fixture
def redis_server():
    with RedisServer() as r:
        yield r

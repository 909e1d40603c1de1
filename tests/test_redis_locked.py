"""The Responses store's Redis as ``pdserve serve --gateways N`` starts it (cluster/serve.py): loopback
only, a generated password kept off every command line, protected mode. A process at a worker's network
position (any process of the host) without the password reads and writes nothing (#47)."""

from __future__ import annotations

import os
import stat
from urllib.parse import urlsplit

import pytest
import redis

from cluster.serve import redis_server, remove_redis_config
from gateway.dialects.responses.redis_store import KEY_PREFIX


def test_the_store_needs_the_password_and_the_gateways_url_has_it(redis_url):
    parts = urlsplit(redis_url)
    assert parts.hostname == "127.0.0.1" and len(parts.password or "") == 64
    owner = redis.Redis.from_url(redis_url)
    owner.set(KEY_PREFIX + "resp_secret", b"a tenant's conversation")
    stranger = redis.Redis(host=parts.hostname, port=parts.port)  # what a worker pod could try
    for attempt in (lambda: stranger.get(KEY_PREFIX + "resp_secret"), lambda: stranger.keys("*")):
        with pytest.raises(redis.AuthenticationError):
            attempt()
    guesser = redis.Redis(host=parts.hostname, port=parts.port, password="guess")
    with pytest.raises(redis.AuthenticationError):
        guesser.get(KEY_PREFIX + "resp_secret")
    assert owner.get(KEY_PREFIX + "resp_secret") == b"a tenant's conversation"  # untouched
    owner.delete(KEY_PREFIX + "resp_secret")


def test_the_password_is_in_a_private_file_never_on_the_command_line():
    argv, url = redis_server(max_mb=8)
    try:
        password = urlsplit(url).password
        assert not any(password in arg for arg in argv)  # `ps` shows argv to every user of the host
        config = argv[1]
        assert stat.S_IMODE(os.stat(config).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(config)).st_mode) == 0o700
        assert open(config).read() == f"requirepass {password}\nprotected-mode yes\n"
        assert argv[argv.index("--bind") + 1] == "127.0.0.1"
    finally:
        remove_redis_config(argv)
    assert not os.path.exists(os.path.dirname(argv[1]))

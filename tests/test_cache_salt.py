"""cache_salt (vLLM's per-request field) keeps tenants' prefix caches apart: it enters the first block's
hash, the same function in gateway and nodes, so differently salted requests never share prefix KV.
Exact hashes are computed here from the definition (SHA-256, 32 bytes, little-endian, chained)."""

from __future__ import annotations

import hashlib
import struct

import httpx
import pytest

from engine.kv.block_manager import BlockManager
from engine.sampling.params import SamplingParams
from engine.sched.sequence import Sequence
from protocol.hashing import ROOT_HASH, block_hashes
from tests.fake_backend import API_KEYS, MODEL, live_gateway
from tests.invariants import assert_no_leak

HEADERS = {"Authorization": f"Bearer {API_KEYS[0]}"}


def sha(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest(), "little")


def expected_hashes(tokens: list[int], block_size: int, salt: str) -> list[int]:
    parent = sha(b"pdserve-cache-salt\0" + salt.encode()) if salt else ROOT_HASH
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *tokens[start : start + block_size])
        parent = sha(parent.to_bytes(32, "little") + block)
        out.append(parent)
    return out


def test_salted_block_hashes_are_exact_and_apart():
    tokens = list(range(100, 110))
    for salt in ("", "tenant-a", "tenant-b", "日本"):
        assert block_hashes(tokens, 4, salt) == expected_hashes(tokens, 4, salt)
    plain, a, b = (block_hashes(tokens, 4, s) for s in ("", "tenant-a", "tenant-b"))
    assert len(plain) == 2 and not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert block_hashes(tokens, 4, "tenant-a") == a  # deterministic: one salt, one chain


def salted_seq(seq_id: int, tokens: list[int], salt: str) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(cache_salt=salt))


def compute(bm: BlockManager, seq: Sequence) -> None:
    _, num_hit = bm.prefix_hit(seq)  # allocate takes these and counts the new tokens from there
    bm.allocate(seq, seq.num_tokens - num_hit)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_block_manager_shares_prefix_blocks_only_within_a_salt():
    bm = BlockManager(num_blocks=12, block_size=4)
    tokens = list(range(9))  # two full blocks and one token
    a = salted_seq(0, tokens, "tenant-a")
    compute(bm, a)
    assert a.block_table == [0, 1, 2]
    assert [bm.block_hash[x] for x in a.block_table] == [*expected_hashes(tokens, 4, "tenant-a"), None]
    b = salted_seq(1, tokens, "tenant-b")
    assert bm.prefix_hit(b) == ([], 0) and bm.match_prefix(tokens, "tenant-b") == ([], 0)
    compute(bm, b)
    assert b.block_table == [3, 4, 5] and b.num_cached_tokens == 0
    plain = salted_seq(2, tokens, "")
    assert bm.prefix_hit(plain) == ([], 0)
    again = salted_seq(3, tokens, "tenant-a")
    assert bm.prefix_hit(again) == ([0, 1], 8) and bm.match_prefix(tokens, "tenant-a") == ([0, 1], 8)
    compute(bm, again)
    assert again.block_table == [0, 1, 6] and again.num_cached_tokens == 8
    for seq in (a, b, again):
        bm.deallocate(seq)
    assert_no_leak(bm)


@pytest.fixture(scope="module")
def live(tok_dir):
    with live_gateway(tok_dir, max_model_len=128) as server:
        yield server


def cached_tokens(live, path: str, body: dict) -> int:
    r = httpx.post(live.base_url + path, json={"model": MODEL, **body}, headers=HEADERS, timeout=30)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    if "cache_read_input_tokens" in usage:  # Anthropic's Messages
        return usage["cache_read_input_tokens"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return details["cached_tokens"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": list(range(40, 60)), "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "The quick brown fox " * 4}], "max_tokens": 1},
        ),
        ("/v1/responses", {"input": "The lazy dog sat on the mat " * 3, "max_output_tokens": 1}),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "Hello world, hello there! " * 3}], "max_tokens": 1},
        ),
    ],
)
def test_each_api_carries_cache_salt_to_the_workers(live, backend, path, body):
    assert cached_tokens(live, path, {**body, "cache_salt": "tenant-a"}) == 0
    assert cached_tokens(live, path, {**body, "cache_salt": "tenant-b"}) == 0  # another tenant: no hit
    assert cached_tokens(live, path, body) == 0  # unsalted: no hit on either
    assert cached_tokens(live, path, {**body, "cache_salt": "tenant-a"}) > 0  # its own tenant: a hit
    assert [r.sampling.cache_salt for r in backend.received] == ["tenant-a", "tenant-b", "", "tenant-a"]


@pytest.mark.parametrize(
    "salt, message",
    [
        ("", "cache_salt must be a non-empty string of at most 1024 characters, got 0"),
        ("x" * 1025, "cache_salt must be a non-empty string of at most 1024 characters, got 1025"),
        (7, "cache_salt must be a string, got 7"),
    ],
)
def test_a_bad_cache_salt_is_a_400(live, backend, salt, message):
    r = httpx.post(
        live.base_url + "/v1/completions",
        headers=HEADERS,
        timeout=30,
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": salt},
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == message and r.json()["error"]["param"] == "cache_salt"
    assert backend.received == []


def test_a_salt_per_api_key_keeps_keys_apart_and_each_keys_prefixes_shared(tok_dir):
    """gateway.cache_salt_per_api_key: the same prompt under another key is no hit (nor a timing probe);
    under the same key it is, with and without a request salt of its own (each kept apart)."""
    body = {"prompt": list(range(40, 60)), "max_tokens": 1}
    with live_gateway(tok_dir, max_model_len=128, limits_given={"cache_salt_per_api_key": True}) as live:

        def cached(key: str, extra: dict | None = None) -> int:
            headers = {"Authorization": f"Bearer {key}"}
            r = httpx.post(
                live.base_url + "/v1/completions", json={"model": MODEL, **body, **(extra or {})}, headers=headers
            )
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(API_KEYS[0]) == 0
        assert cached(API_KEYS[1]) == 0  # another key: nothing shared
        assert cached(API_KEYS[0]) > 0  # its own key: a hit
        assert cached(API_KEYS[0], {"cache_salt": "x"}) == 0  # its own salt on top: apart again
        salts = [r.sampling.cache_salt for r in live.backend.received]
        assert salts[0] == salts[2] and len({salts[0], salts[1], salts[3]}) == 3
        assert all(len(s) == 64 and API_KEYS[0] not in s for s in salts)  # a digest, never the key

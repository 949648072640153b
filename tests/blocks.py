"""Requests and block hashes for the block pool, KV-cache manager and scheduler tests."""

from __future__ import annotations

from engine.block_pool import hash_block
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int], block_size: int, salt: bytes = b"") -> Request:
    params = SamplingParams(max_tokens=None)
    return Request(request_id, list(tokens), params, set(), 10_000, 0, salt, block_size)


def chain(token_ids: list[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes

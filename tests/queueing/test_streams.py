"""The Redis Streams layer against a real redis-server (the session fixture)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from redis.exceptions import ConnectionError, OutOfMemoryError

from queueing import streams
from queueing.schema import (
    MAX_MESSAGE_BYTES,
    MAX_PROMPT_TOKENS,
    GenerateRequest,
    SchemaError,
    TokenChunk,
    keys,
    unpack_bounded,
)
from service.delivery import _peek_request_id

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


def _request(i: int) -> bytes:
    return GenerateRequest(request_id=f"r{i}", prompt="hi").encode()


async def _clients(redis_url):
    return streams.connect(redis_url, blocking=True), streams.connect(redis_url)


async def test_ensure_group_is_idempotent(redis_url):
    rb, r = await _clients(redis_url)
    await streams.ensure_group(r)
    await streams.ensure_group(r)
    groups = await r.xinfo_groups(keys.requests)
    assert [g["name"] for g in groups] == [keys.group.encode()]
    await rb.aclose()
    await r.aclose()


async def test_read_drains_own_pending_first_then_new(redis_url):
    rb, r = await _clients(redis_url)
    await streams.ensure_group(r)
    ids = [await r.xadd(keys.requests, {"data": _request(i)}) for i in range(3)]
    first = streams.RequestConsumer(rb, r, "w1", block_ms=100, count=2)
    got = await first.read()
    assert [(e.data, e.deliveries) for e in got] == [(_request(0), 1), (_request(1), 1)]
    # A restart under the same name sees its two pending entries again (a second delivery),
    # then the new one.
    again = streams.RequestConsumer(rb, r, "w1", block_ms=100, count=2)
    assert [(e.entry_id, e.deliveries) for e in await again.read()] == [
        (i.decode(), 2) for i in ids[:2]
    ]
    assert [(e.entry_id, e.deliveries) for e in await again.read()] == [(ids[2].decode(), 1)]
    assert await again.read() == []  # one short BLOCK, nothing new
    await again.ack(*(i.decode() for i in ids))
    assert (await r.xpending(keys.requests, keys.group))["pending"] == 0
    await rb.aclose()
    await r.aclose()


async def test_read_recreates_a_deleted_group_and_returns_trimmed_entries(redis_url):
    rb, r = await _clients(redis_url)
    consumer = streams.RequestConsumer(rb, r, "w1", block_ms=100)
    with pytest.raises(streams.GroupLost):  # NOGROUP: created again, and said so
        await consumer.read()
    assert await consumer.read() == []
    entry = (await r.xadd(keys.requests, {"data": _request(0)})).decode()
    assert await consumer.read() == [(entry, _request(0), 1)]
    await r.xdel(keys.requests, entry)
    restarted = streams.RequestConsumer(rb, r, "w1", block_ms=100)
    # Pending but deleted (Redis does not count such a delivery).
    assert [e[:2] for e in await restarted.read()] == [(entry, None)]
    await rb.aclose()
    await r.aclose()


async def test_claim_stale_takes_over_idle_entries_only(redis_url):
    rb, r = await _clients(redis_url)
    await streams.ensure_group(r)
    entry = (await r.xadd(keys.requests, {"data": _request(0)})).decode()
    dead = streams.RequestConsumer(rb, r, "dead", block_ms=100)
    assert await dead.read() == [(entry, _request(0), 1)]
    alive = streams.RequestConsumer(rb, r, "alive", block_ms=100)
    assert await alive.claim_stale(min_idle_ms=10_000) == []
    await asyncio.sleep(0.25)
    await dead.touch([entry])  # a live owner keeps its entry from going idle
    assert await alive.claim_stale(min_idle_ms=200) == []
    await asyncio.sleep(0.25)
    assert await alive.claim_stale(min_idle_ms=200) == [(entry, _request(0), 2)]
    pending = await r.xpending_range(keys.requests, keys.group, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"alive"]
    await rb.aclose()
    await r.aclose()


async def test_dead_letter_records_entry_and_reason(redis_url):
    rb, r = await _clients(redis_url)
    consumer = streams.RequestConsumer(rb, r, "w1")
    await consumer.dead_letter("1-0", b"\xc1", "not valid msgpack")
    # Issue 12: a 24 MiB entry was copied whole; only a prefix and the size are kept.
    huge = b"\xdd" + b"\x80" * (24 << 20)
    await consumer.dead_letter("2-0", huge, "too large")
    [(_, fields), (_, big)] = await r.xrange(keys.dead)
    assert fields == {
        b"entry_id": b"1-0",
        b"data": b"\xc1",
        b"data_bytes": b"1",
        b"reason": b"not valid msgpack",
    }
    assert big[b"data"] == huge[: streams.DEAD_LETTER_DATA_BYTES]
    assert int(big[b"data_bytes"]) == len(huge)
    await rb.aclose()
    await r.aclose()


async def test_a_group_read_whose_reply_was_lost_fails_and_its_entries_are_read_again(
    redis_url, lose_a_reply
):
    """Docs/reliability.md item 31: an XREADGROUP or XAUTOCLAIM that ran but whose reply was
    lost (Redis stopping in between) left its entries pending under the consumer, and redis-py
    sent the command again on its own, moving past them. Now the error reaches the caller, and
    after `reread_pending` the consumer reads them from its pending list."""
    rb, r = await _clients(redis_url)
    await streams.ensure_group(r)
    consumer = streams.RequestConsumer(rb, r, "w1", block_ms=100)
    assert await consumer.read() == [] and consumer.caught_up
    new = (await r.xadd(keys.requests, {"data": _request(0)})).decode()
    lose_a_reply("XREADGROUP")
    with pytest.raises(ConnectionError, match="XREADGROUP was lost"):
        await consumer.read()
    consumer.reread_pending()
    assert [(e.entry_id, e.deliveries) for e in await consumer.read()] == [(new, 2)]
    assert await consumer.read() == [] and consumer.caught_up
    await consumer.ack(new)
    # A claim of a dead consumer's entry, its reply lost: the entry is this consumer's now.
    claimed = (await r.xadd(keys.requests, {"data": _request(1)})).decode()
    await r.xreadgroup(keys.group, "dead", {keys.requests: ">"}, count=1)
    lose_a_reply("XAUTOCLAIM")
    with pytest.raises(ConnectionError, match="XAUTOCLAIM was lost"):
        await consumer.claim_stale(0)
    consumer.reread_pending()
    got = await consumer.read()
    assert [(e.entry_id, e.deliveries) for e in got] == [(claimed, 3)]
    await consumer.ack(claimed)
    await rb.aclose()
    await r.aclose()


async def test_decoding_is_bounded_before_it_allocates():
    """Issue 12: an array of millions of empty maps decoded after the size check had refused
    it. Oversize entries are refused unread, and no container may outgrow a valid message."""
    many_maps = msgpack.packb([{}] * (MAX_PROMPT_TOKENS + 1))
    assert len(many_maps) < MAX_MESSAGE_BYTES  # small on the wire, large once decoded
    with pytest.raises(ValueError, match="exceeds max_array_len"):
        unpack_bounded(many_maps)
    with pytest.raises(SchemaError, match="not valid msgpack"):
        GenerateRequest.decode(many_maps)
    oversize = b"\xdd" + b"\x80" * MAX_MESSAGE_BYTES
    with pytest.raises(SchemaError, match="too large"):
        GenerateRequest.decode(oversize)
    assert _peek_request_id(oversize) is None


async def test_publish_pipelines_chunks_with_ttl_and_read_response(redis_url):
    r = streams.connect(redis_url)
    publisher = streams.ResponsePublisher(r, ttl_s=60)
    items = [
        (keys.response(rid), TokenChunk(rid, seq, token_ids=[seq], text=str(seq)))
        for seq in range(3)
        for rid in ("a", "b")
    ]
    await publisher.publish(items)
    for rid in ("a", "b"):
        chunks = await streams.read_response(r, keys.response(rid), page=2)
        assert [(c.seq, c.token_ids, c.text) for c in chunks] == [
            (i, [i], str(i)) for i in range(3)
        ]
        assert 0 < await r.ttl(keys.response(rid)) <= 60
    assert await streams.read_response(r, keys.response("none")) == []
    await r.aclose()


async def test_a_response_key_that_refuses_its_chunks_fails_alone(redis_url):
    """Issue 12: one response key turned into a string made every write of the batch fail,
    and each retry appended the other streams' chunks again. Now that key's chunks come back
    refused and every other one is stored once; out of memory refuses the whole batch."""
    r = streams.connect(redis_url)
    publisher = streams.ResponsePublisher(r, ttl_s=60)
    await r.set(keys.response("bad"), b"not a stream")
    rids = ("a", "bad", "b")
    items = [(keys.response(rid), TokenChunk(rid, seq)) for seq in range(2) for rid in rids]
    refused = await publisher.publish(items)
    assert list(refused) == [keys.response("bad")]
    assert str(refused[keys.response("bad")]).startswith("WRONGTYPE")
    for rid in ("a", "b"):
        assert [c.seq for c in await streams.read_response(r, keys.response(rid))] == [0, 1]
    # Out of memory (noeviction, Redis's default policy) refuses every write: none is stored,
    # so retrying the batch appends nothing twice.
    policy = (await r.config_get("maxmemory-policy"))["maxmemory-policy"]
    await r.config_set("maxmemory-policy", "noeviction")
    await r.config_set("maxmemory", 1)
    try:
        more = [(keys.response(rid), TokenChunk(rid, 2)) for rid in ("a", "b")]
        with pytest.raises(OutOfMemoryError):
            await publisher.publish(more)
    finally:
        await r.config_set("maxmemory", 0)
        await r.config_set("maxmemory-policy", policy)
    assert [await r.xlen(keys.response(rid)) for rid in ("a", "b")] == [2, 2]
    await r.aclose()


async def test_a_state_or_dead_letter_key_of_the_wrong_type_refuses_only_its_write(redis_url):
    """Issue 12: a done mark on a `kvrail:req:{id}` turned into a string (or a dead letter on
    such a `kvrail:dead`) raised, and the publisher retried it forever. The refusal now comes
    back, the other marks are stored."""
    r = streams.connect(redis_url)
    await r.set(keys.request_state("bad"), b"not a hash")
    refused = await streams.mark_done(r, ["a", "bad", "b"], 60)
    assert list(refused) == ["bad"] and str(refused["bad"]).startswith("WRONGTYPE")
    assert [await r.hget(keys.request_state(rid), "state") for rid in "ab"] == [b"done"] * 2
    consumer = streams.RequestConsumer(r, r, "w1")
    assert await consumer.dead_letter("1-0", b"x", "why") is None
    await r.delete(keys.dead)
    await r.set(keys.dead, b"not a stream")
    assert str(await consumer.dead_letter("1-0", b"x", "why")).startswith("WRONGTYPE")
    await r.aclose()


async def test_own_request_deduplicates_on_the_entry_id(redis_url):
    r = streams.connect(redis_url)
    assert await streams.own_request(r, "x", "1-0", 60) == ("1-0", False)
    assert await streams.own_request(r, "x", "1-0", 60) == ("1-0", False)  # redelivered
    assert await streams.own_request(r, "x", "2-0", 60) == ("1-0", False)  # duplicate
    await streams.mark_done(r, ["x"], 60)
    assert await r.hgetall(keys.request_state("x")) == {b"entry": b"1-0", b"state": b"done"}
    await r.hset(keys.request_state("y"), "aborted", 1)  # the client gave up first
    assert await streams.own_request(r, "y", "3-0", 60) == ("3-0", True)
    await r.aclose()

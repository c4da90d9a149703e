"""Messages packed by the wire schema before its fields were derived from the dataclass
annotations (issue 11), recorded as bytes: each must still decode to the same fields, and
encoding those fields again must give the same bytes, so old and new processes can share a
Redis during a rolling upgrade."""

from __future__ import annotations

import msgpack
import pytest

from queueing.schema import Abort, GenerateRequest, SchemaError, TokenChunk, WorkerInfo

RECORDED = [
    (
        "88a17601aa726571756573745f6964a6636d706c2d31a670726f6d7074c0b070726f6d70745f746f6b656e"
        "5f69647393010203a86d65737361676573c0a873616d706c696e6788a16e02ab74656d7065726174757265"
        "cb3fe0000000000000a5746f705f6b04a47365656407aa6d61785f746f6b656e7308a473746f7091a178aa"
        "69676e6f72655f656f73c3aa6c6f6769745f6269617381a135cbbff8000000000000a87265706c795f746f"
        "b26b767261696c3a726573703a636d706c2d31ab646561646c696e655f6d73cf0000018bcfe56800",
        GenerateRequest(
            "cmpl-1",
            prompt_token_ids=[1, 2, 3],
            sampling={
                "n": 2,
                "temperature": 0.5,
                "top_k": 4,
                "seed": 7,
                "max_tokens": 8,
                "stop": ["x"],
                "ignore_eos": True,
                "logit_bias": {"5": -1.5},
            },
            reply_to="kvrail:resp:cmpl-1",
            deadline_ms=1700000000000,
        ),
    ),
    (
        "88a17601aa726571756573745f6964a6636861742d31a670726f6d7074c0b070726f6d70745f746f6b656e"
        "5f696473c0a86d657373616765739182a4726f6c65a475736572a7636f6e74656e74a26869a873616d706c"
        "696e6780a87265706c795f746fc0ab646561646c696e655f6d73c0",
        GenerateRequest("chat-1", messages=[{"role": "user", "content": "hi"}]),
    ),
    (
        "8ca17601aa726571756573745f6964a6636d706c2d31a373657103a5696e64657801a9746f6b656e5f6964"
        "7392090aa474657874a26162a86c6f6770726f627391929209cbbfd0000000000000920bcbbff800000000"
        "0000af70726f6d70745f6c6f6770726f627392c0919302cbbfe000000000000001ad66696e6973685f7265"
        "61736f6ea473746f70ab73746f705f726561736f6ea178a5757361676583ad70726f6d70745f746f6b656e"
        "7303b1636f6d706c6574696f6e5f746f6b656e7302ac746f74616c5f746f6b656e7305a56572726f72c0",
        TokenChunk(
            "cmpl-1",
            3,
            index=1,
            token_ids=[9, 10],
            text="ab",
            logprobs=[[[9, -0.25], [11, -1.5]]],
            prompt_logprobs=[None, [[2, -0.5, 1]]],
            finish_reason="stop",
            stop_reason="x",
            usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        ),
    ),
    (
        "8ca17601aa726571756573745f6964a6636d706c2d32a373657100a5696e64657800a9746f6b656e5f6964"
        "7390a474657874a0a86c6f6770726f6273c0af70726f6d70745f6c6f6770726f6273c0ad66696e6973685f"
        "726561736f6ea56572726f72ab73746f705f726561736f6ec0a57573616765c0a56572726f72a4626f6f6d",
        TokenChunk("cmpl-2", 0, error="boom", finish_reason="error"),
    ),
    ("82a17601aa726571756573745f6964a6636d706c2d31", Abort("cmpl-1")),
    (
        "89a17601a46e616d65a27731a56d6f64656ca56c6c616d61ad6d61785f6d6f64656c5f6c656ecd0800aa73"
        "7461727465645f6d7301ac6865617274626561745f6d7302ab6e756d5f72756e6e696e6703ab6e756d5f77"
        "616974696e6704ae6b765f63616368655f7573616765cb3fd0000000000000",
        WorkerInfo(
            "w1",
            "llama",
            2048,
            started_ms=1,
            heartbeat_ms=2,
            num_running=3,
            num_waiting=4,
            kv_cache_usage=0.25,
        ),
    ),
]


@pytest.mark.parametrize(("packed", "expected"), RECORDED, ids=lambda x: type(x).__name__)
def test_message_packed_before_the_change_decodes_after_it(packed, expected):
    message = type(expected).decode(bytes.fromhex(packed))
    assert message == expected
    assert message.encode() == bytes.fromhex(packed)


def test_a_field_added_later_travels_only_when_set():
    """`GenerateRequest.priority` came after the recordings above: at 0 a message packs as
    it did before (an older worker decodes it), set it travels and decodes, strictly."""
    plain = GenerateRequest("cmpl-1", prompt="x")
    assert GenerateRequest("cmpl-1", prompt="x", priority=0).encode() == plain.encode()
    urgent = GenerateRequest("cmpl-1", prompt="x", priority=-3)
    assert urgent.encode() != plain.encode()
    assert GenerateRequest.decode(urgent.encode()) == urgent
    for bad, why in [(True, "has type bool"), (1.0, "has type float"), (2**31, "must be in")]:
        packed = msgpack.packb({"v": 1, "request_id": "r", "prompt": "x", "priority": bad})
        with pytest.raises(SchemaError, match=why):
            GenerateRequest.decode(packed)


def test_beam_search_travels_only_when_set():
    """`GenerateRequest.beam_search` came later too: unset, a message packs as before; set,
    it travels, strictly checked against `BeamSearchParams`'s fields."""
    plain = GenerateRequest("cmpl-1", prompt="x")
    assert GenerateRequest("cmpl-1", prompt="x", beam_search=None).encode() == plain.encode()
    beams = GenerateRequest("cmpl-1", prompt="x", beam_search={"beam_width": 4, "max_tokens": 8})
    assert GenerateRequest.decode(beams.encode()) == beams
    for bad, why in [
        ({"beam_width": 4}, "needs 'max_tokens'"),
        ({"beam_width": 4.0, "max_tokens": 8}, "has type float"),
        ({"beam_width": 4, "max_tokens": 8, "n": 4}, "unknown beam_search field 'n'"),
    ]:
        packed = msgpack.packb({"v": 1, "request_id": "r", "prompt": "x", "beam_search": bad})
        with pytest.raises(SchemaError, match=why):
            GenerateRequest.decode(packed)

"""protocol.codec: typed msgpack records round-trip; anything else is a WireError."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import msgpack
import pytest

from protocol.codec import WireError, decode, encode, wire_record
from protocol.kv_messages import BlockWrite, Commit, Handshake, KVCompat


@wire_record("test.inner")
@dataclass(slots=True)
class Inner:
    name: str
    weight: float


@wire_record("test.outer")
@dataclass(slots=True)
class Outer:
    count: int
    flag: bool
    blob: bytes
    ids: list[int]
    names: list[str]
    inner: Inner
    inners: list[Inner] = field(default_factory=list)
    maybe: int | None = None
    maybe_inner: Inner | None = None

    def __post_init__(self):
        assert self.count >= 0, "count must be >= 0"


def _outer(**overrides):
    values = dict(
        count=3,
        flag=True,
        blob=b"\x00\xff",
        ids=[1, -2],
        names=["a"],
        inner=Inner("x", 0.5),
        inners=[Inner("y", 1.5)],
        maybe=None,
        maybe_inner=Inner("z", 2.0),
    )
    values.update(overrides)
    return values


def _raw(tag, fields) -> bytes:
    return msgpack.packb([tag, fields], use_bin_type=True)


def test_round_trip_equals_original():
    record = Outer(**_outer())
    assert decode(encode(record)) == record
    commit = Commit("r", 2, "inc", first_token=7, first_logprob=-0.25, top_token_ids=[7, 9], top_logprobs=[-0.25, -3.0])
    assert decode(encode(commit)) == commit
    hs = Handshake(KVCompat(1, "m", "float32", 8, 2, 64, 16), "inc", "host", ["zmq", "shm"])
    assert decode(encode(hs), expected=Handshake) == hs


def test_int_accepted_for_float_but_not_bool_for_int():
    good = _outer(inner=["test.inner", {"name": "x", "weight": 1}])
    fields = {k: v for k, v in _outer().items()}
    fields["inner"] = ["test.inner", {"name": "x", "weight": 1}]
    fields["inners"] = []
    fields["maybe_inner"] = None
    record = decode(_raw("test.outer", fields))
    assert record.inner.weight == 1.0 and isinstance(record.inner.weight, float)
    assert good  # the float field took an int
    fields["count"] = True
    with pytest.raises(WireError, match=r"test.outer.count: expected int, got bool"):
        decode(_raw("test.outer", fields))


def _fields(**overrides):
    fields = dict(
        count=1,
        flag=False,
        blob=b"",
        ids=[],
        names=[],
        inner=["test.inner", {"name": "n", "weight": 0.0}],
        inners=[],
        maybe=None,
        maybe_inner=None,
    )
    fields.update(overrides)
    return fields


@pytest.mark.parametrize(
    "fields, message",
    [
        (_fields(ids=[1, "2"]), r"test.outer.ids\[1\]: expected int, got str"),
        (_fields(names="abc"), r"test.outer.names: expected a list"),
        (_fields(blob="text"), r"test.outer.blob: expected bytes, got str"),
        (_fields(maybe=1.5), r"test.outer.maybe: expected int, got float"),
        (_fields(inner=["test.outer", {}]), r"test.outer.inner"),
        (_fields(inner=["no.such", {}]), r"test.outer.inner: expected a test.inner record, got .no.such."),
        (_fields(count=-1), r"invalid record: count must be >= 0"),
    ],
)
def test_wrong_types_name_the_field(fields, message):
    with pytest.raises(WireError, match=message):
        decode(_raw("test.outer", fields))


def test_missing_and_extra_fields_rejected():
    fields = _fields()
    del fields["flag"]
    with pytest.raises(WireError, match=r"missing field\(s\) \['flag'\]"):
        decode(_raw("test.outer", fields))
    with pytest.raises(WireError, match=r"unexpected field\(s\) \['evil'\]"):
        decode(_raw("test.outer", _fields(evil=1)))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x93\x01\x02",
        msgpack.packb(["kv.commit"]),
        msgpack.packb({"a": 1}),
        msgpack.packb(["nope", {}]),
        msgpack.packb([1, {}]),
        msgpack.packb(["kv.commit", {1: 2}]),
        b"\x91" * 100_000,
    ],  # nesting far deeper than any record
)
def test_garbage_is_a_wire_error(data):
    with pytest.raises(WireError):
        decode(data)


def test_size_limit_checked_before_parsing():
    record = BlockWrite("r", 1, "inc", list(range(1000)), False, 0)
    data = encode(record)
    assert decode(data, max_bytes=len(data)) == record
    with pytest.raises(WireError, match=f"frame of {len(data)} bytes exceeds the limit of {len(data) - 1} bytes"):
        decode(data, max_bytes=len(data) - 1)


def test_expected_type_enforced():
    with pytest.raises(WireError, match="expected Handshake, got Commit"):
        decode(encode(Commit("r", 1, "i")), expected=Handshake)


def test_record_invariants_apply_on_decode():
    fields = {
        "rid": "r",
        "generation": 1,
        "sender_incarnation": "i",
        "dst_block_ids": [3, 3],
        "inline": False,
        "num_bytes": 0,
    }
    with pytest.raises(WireError, match="duplicate destination block"):
        decode(_raw("kv.block_write", fields))


def test_duplicate_tag_registration_refused():
    with pytest.raises(AssertionError, match="registered twice"):
        wire_record("test.inner")(dataclass(slots=True)(type("Other", (), {"__annotations__": {"a": int}})))


def test_protocol_package_is_torch_free():
    import subprocess
    import sys

    code = "import sys, protocol.codec, protocol.kv_messages, protocol.zmq_util; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_sampling_logit_bias_round_trips_and_rejects_a_wrong_entry():
    from protocol.serving import SamplingSpec, TokenBias

    spec = SamplingSpec(max_tokens=4, logit_bias=[TokenBias(5, -100.0), TokenBias(9, 2)])
    back = decode(encode(spec), expected=SamplingSpec)
    assert back == spec and back.logit_bias_map() == {5: -100.0, 9: 2.0}
    assert SamplingSpec(max_tokens=1).logit_bias_map() is None
    hostile = encode(spec).replace(b"serve.token_bias", b"serve.token_bia_")
    with pytest.raises(WireError, match=r"serve.sampling.logit_bias\[0\]: expected a serve.token_bias record"):
        decode(hostile)
    wrong = _raw(
        "serve.sampling",
        {**msgpack.unpackb(encode(spec))[1], "logit_bias": [["serve.token_bias", {"token_id": "5", "bias": 1.0}]]},
    )
    with pytest.raises(WireError, match=r"serve.token_bias.token_id: expected int, got str"):
        decode(wrong)


def test_prompt_logprobs_frame_round_trips_and_rejects_a_wrong_one():
    from protocol.serving import PROMPT_LOGPROBS_PER_FRAME, PromptLogprobs, TokenLogprobRecord

    frame = PromptLogprobs("r", 256, [TokenLogprobRecord(7, -1.5, [3, 7], [-0.5, -1.5])], [2])
    assert decode(encode(frame), expected=PromptLogprobs) == frame
    fields = msgpack.unpackb(encode(frame))[1]
    for wrong, why in (
        ({"ranks": [2, 1]}, "invalid record"),
        ({"start": -1}, "invalid record"),
        (
            {
                "logprobs": fields["logprobs"] * (PROMPT_LOGPROBS_PER_FRAME + 1),
                "ranks": [1] * (PROMPT_LOGPROBS_PER_FRAME + 1),
            },
            "invalid record",
        ),
        ({"ranks": ["2"]}, "expected int, got str"),
    ):
        with pytest.raises(WireError, match=why):
            decode(_raw("serve.prompt_logprobs", {**fields, **wrong}))


def test_structured_output_round_trips_and_a_wrong_one_is_rejected():
    from protocol.serving import MAX_REASONING_END_CHARS, MAX_STRUCTURED_OUTPUT_CHARS, SamplingSpec, StructuredOutput

    spec = SamplingSpec(max_tokens=4, structured_output=StructuredOutput("regex", r"\d+", after="</think>"))
    assert decode(encode(spec), expected=SamplingSpec) == spec
    fields = msgpack.unpackb(encode(spec))[1]
    for bad, message in (
        (
            ["serve.structured_output", {"kind": "python", "spec": "", "after": ""}],
            "unknown structured output kind 'python'",
        ),
        (
            [
                "serve.structured_output",
                {"kind": "regex", "spec": "a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1), "after": ""},
            ],
            f"{MAX_STRUCTURED_OUTPUT_CHARS + 1} characters of grammar",
        ),
        (
            ["serve.structured_output", {"kind": "regex", "spec": "a", "after": "a" * (MAX_REASONING_END_CHARS + 1)}],
            f"{MAX_REASONING_END_CHARS + 1} characters of reasoning end",
        ),
        (
            ["serve.structured_output", {"kind": "regex", "spec": 5, "after": ""}],
            "serve.structured_output.spec: expected str, got int",
        ),
    ):
        with pytest.raises(WireError, match=re.escape(message)):
            decode(_raw("serve.sampling", {**fields, "structured_output": bad}), max_bytes=1 << 20)

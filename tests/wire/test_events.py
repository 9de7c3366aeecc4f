"""Wire protocol: payload models, topics, hostile input refused with clear errors, schemas in
sync."""

import base64
import builtins
import dataclasses
import io
import json
import math
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from agent_monitor import Progress, score_prefix
from agent_monitor import wire as ev
from agent_monitor.cli import main as cli_main
from agent_monitor.criteria import load_criteria
from agent_monitor.policy import Policy, PolicyState
from agent_monitor.prompts import Step
from agent_monitor.testing import FakeJudge
from agent_monitor.wire import (
    MAX_STEP_CHARS,
    ErrorOut,
    EventError,
    ImageIn,
    ProgressOut,
    RunEnd,
    RunStart,
    SignalOut,
    StepIn,
    TopicError,
    _inputs,
    check_run_id,
    decode_event,
    parse_topic,
    topic,
)
from agent_monitor.wire._schema import SCHEMA_MODELS
from tests.paths import REPO


def img(fmt: str = "PNG", w: int = 8, h: int = 6) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, format=fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode(kind: str, payload: Any, **kw: Any) -> Any:
    """decode_event on `agents/r1/{kind}` with a dict (JSON-encoded here) or raw bytes/str."""
    raw = json.dumps(payload) if isinstance(payload, (dict, list)) else payload
    run_id, model = decode_event(f"agents/r1/{kind}", raw, **kw)
    assert run_id == "r1"
    return model


def refused(kind: str, payload: Any, **kw: Any) -> EventError:
    with pytest.raises(EventError) as info:
        decode(kind, payload, **kw)
    e = info.value
    assert e.reason in (
        "payload_too_large",
        "bad_json",
        "bad_topic",
        "unknown_topic",
        "invalid",
        "bad_image",
    )
    assert "\n" not in e.message and len(e.message) <= 700
    return e


# -- good events round-trip --


def test_start_round_trips_and_loads_its_rubric() -> None:
    payload = {
        "task": "Reverse a string.",
        "criteria": {"correct": "is the output reversed", "tidy": "is the code tidy"},
        "images": [b64(img())],
        "policy": {"abort_below": 0.2, "patience": 2, "resample_below": None},
        "labels": {"group": "g1", "model_name": "qwen"},
        "expected": "olleh",
    }
    start = decode("start", payload)
    assert isinstance(start, RunStart)
    assert start.task == "Reverse a string." and start.expected == "olleh"
    assert start.images[0].mime == "image/png" and start.images[0].decoded() == img()
    assert [c.name for c in start.rubric().criteria] == ["correct", "tidy"]
    pol = start.resolved_policy(Policy(abort_below=0.5, resample_below=0.3, min_steps=1))
    assert (pol.abort_below, pol.patience, pol.resample_below, pol.min_steps) == (0.2, 2, None, 1)
    again = RunStart.model_validate_json(start.model_dump_json())
    assert again == start
    assert decode("start", json.loads(start.model_dump_json())) == start


@pytest.mark.parametrize(
    "criteria",
    [
        None,
        "progress",
        "robot",
        ["did it compile", {"name": "tests", "description": "do tests pass", "weight": 2}],
        {
            "title": "pipe",
            "criteria": [{"type": "answer_match"}, {"name": "j", "description": "judge it"}],
        },
    ],
)
def test_start_accepts_every_inline_criteria_shape(criteria: Any) -> None:
    start = decode("start", {"task": "t", "criteria": criteria})
    assert start.rubric().hash == load_criteria(criteria).hash


def test_step_images_in_every_inline_form_normalise_to_objects() -> None:
    png, jpg = img(), img("JPEG")
    step = decode(
        "step",
        {
            "index": 3,
            "text": "clicked OK",
            "images": [
                b64(png),
                {"data": b64(jpg)},
                {"data": b64(png), "mime": "image/jpeg"},
                f"data:image/png;base64,{b64(png)}",
            ],
            "ts": 1700000000.5,
            "meta": {"distance_to_goal": 0.4, "pose": [1, 2, {"z": None}], "ok": True},
        },
    )
    assert isinstance(step, StepIn) and step.index == 3 and step.ts == 1700000000.5
    # The sniffed type replaces whatever `mime` said.
    assert [i.mime for i in step.images] == ["image/png", "image/jpeg", "image/png", "image/png"]
    assert [i.decoded() for i in step.images] == [png, jpg, png, png]
    assert step.meta == {"distance_to_goal": 0.4, "pose": [1, 2, {"z": None}], "ok": True}
    dumped = json.loads(step.model_dump_json(exclude_none=True))
    assert dumped["images"][0] == {"data": b64(png), "mime": "image/png"}
    assert decode("step", dumped) == step


def test_step_minimal_and_image_only() -> None:
    step = decode("step", {"text": "ran ls"})
    assert step.index is None and step.images == [] and step.ts is None and step.meta is None
    assert decode("step", {"text": "", "images": [b64(img())]}).text == ""
    assert decode("step", {"text": "x", "images": None}).images == []


@pytest.mark.parametrize(
    ("ts", "want"),
    [
        ("2025-01-01T00:00:00Z", 1735689600.0),
        ("2025-01-01T01:00:00+01:00", 1735689600.0),
        ("2025-01-01T00:00:00", 1735689600.0),  # no offset: UTC
        (1735689600, 1735689600.0),
    ],
)
def test_step_timestamps_normalise_to_unix_seconds(ts: Any, want: float) -> None:
    assert decode("step", {"text": "x", "ts": ts}).ts == want


@pytest.mark.parametrize(
    ("outcome", "want"), [("success", "success"), ("failure", "failure"), (0.75, 0.75), (1, 1.0)]
)
def test_end_outcomes(outcome: Any, want: Any) -> None:
    assert decode("end", {"outcome": outcome}).outcome == want


@pytest.mark.parametrize("payload", [b"", b"  \n", b"{}"])
def test_empty_end_payload_ends_the_run(payload: bytes) -> None:
    end = decode("end", payload)
    assert isinstance(end, RunEnd) and end.outcome is None


def test_unknown_fields_are_ignored_everywhere() -> None:
    step = decode(
        "step",
        {"text": "x", "harness_version": 7, "images": [{"data": b64(img()), "camera": "left"}]},
    )
    assert step.text == "x" and not hasattr(step, "harness_version")
    assert decode("start", {"task": "t", "x": {"deep": [1]}}).task == "t"
    assert decode("end", {"outcome": "success", "why": "tests pass"}).outcome == "success"


def test_payload_may_be_str_bytearray_or_memoryview() -> None:
    raw = json.dumps({"text": "x"})
    for payload in (raw, raw.encode(), bytearray(raw.encode()), memoryview(raw.encode())):
        assert decode_event("agents/r1/step", payload)[1] == StepIn(text="x")


# -- hostile and broken input --


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"{", "not valid JSON"),
        (b"step 1: clicked", "not valid JSON"),
        (b'{"text": "a",}', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"text": NaN}', "NaN"),
        (b'{"text": "x", "ts": Infinity}', "Infinity"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"text": "x", "index": ' + b"9" * 5000 + b"}", "not acceptable JSON"),
    ],
)
def test_malformed_json_is_bad_json(payload: bytes, needle: str) -> None:
    e = refused("step", payload)
    assert e.reason == "bad_json" and needle in e.message and e.run_id == "r1"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        # The decoder's own message ends in "at" here: the position follows it, without a second
        # "at".
        (
            b'{"index": 1, "text": "line 1\nline 2"}',
            "payload is not valid JSON: Invalid control character at line 1 column 29; "
            "write a tab or line break inside a string as \\t or \\n",
        ),
        (
            b'{"text": "never closed',
            "payload is not valid JSON: Unterminated string starting at line 1 column 10; "
            "send one JSON object (e.g. from json.dumps)",
        ),
        (
            b"step 1: clicked",
            "payload is not valid JSON: Expecting value at line 1 column 1; send one JSON "
            "object (e.g. from json.dumps)",
        ),
    ],
)
def test_a_json_error_reads_as_one_sentence(payload: bytes, message: str) -> None:
    assert refused("step", payload).message == message


@pytest.mark.parametrize(
    ("kind", "payload", "needle"),
    [
        ("step", [1, 2], "must be a JSON object, got array"),
        ("step", b'"just text"', "must be a JSON object, got string"),
        ("step", {}, "text is required"),
        ("step", {"text": 5}, "text: Input should be a valid string (got integer)"),
        ("step", {"text": ["a"]}, "text: Input should be a valid string (got array)"),
        (
            "step",
            {"text": "x", "index": "3"},
            "index: Input should be a valid integer (got string)",
        ),
        ("step", {"text": "x", "index": True}, "index"),
        ("step", {"text": "x", "index": 1.5}, "index"),
        ("step", {"text": "x", "index": 0}, "index: Input should be greater than or equal to 1"),
        ("step", {"text": "x", "index": 10**7}, "index: Input should be less than or equal to"),
        ("step", {"text": "x", "images": "abc"}, "images: Input should be a valid list"),
        ("step", {"text": "x", "images": [5]}, "images[0]"),
        ("step", {"text": "x", "ts": True}, "ts"),
        ("step", {"text": "x", "ts": "yesterday"}, "ts 'yesterday' is not an ISO 8601 date-time"),
        (
            "step",
            {"text": "x", "meta": [1]},
            "meta: Input should be a valid dictionary (got array)",
        ),
        ("step", {"text": ""}, "no text and no images"),
        ("start", {}, "task is required"),
        ("start", {"task": "   "}, "task is empty"),
        ("start", {"task": 42}, "task: Input should be a valid string (got integer)"),
        ("start", {"task": "t", "expected": 1}, "expected"),
        ("end", {"outcome": "win"}, "outcome 'win' is not allowed"),
        ("end", {"outcome": True}, "outcome True is not allowed"),
        ("end", {"outcome": "0.5"}, "outcome '0.5' is not allowed"),
    ],
)
def test_wrong_types_and_missing_fields_name_the_field(
    kind: str, payload: Any, needle: str
) -> None:
    e = refused(kind, payload)
    assert e.reason == "invalid" and needle in e.message, e.message
    assert e.message.startswith(f"{kind}")


def test_several_problems_are_all_named_in_one_line() -> None:
    e = refused("step", {"text": 1, "index": "x", "images": 3})
    assert e.message.startswith("step: index:") and e.message.count("; ") == 2, e.message
    assert "text:" in e.message and "images:" in e.message and "more problem" not in e.message


def test_huge_text_and_too_many_things_are_refused() -> None:
    assert (
        "text: String should have at most 200000 characters"
        in refused("step", {"text": "a" * (MAX_STEP_CHARS + 1)}).message
    )
    assert decode("step", {"text": "a" * MAX_STEP_CHARS}).text
    assert "task: String should have at most" in refused("start", {"task": "a" * 100_001}).message
    assert (
        "images: List should have at most 16 items"
        in refused("step", {"text": "x", "images": [b64(img())] * 17}).message
    )
    labels = {f"k{i}": "v" for i in range(17)}
    assert (
        "17 labels, over the limit of 16"
        in refused("start", {"task": "t", "labels": labels}).message
    )


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ("abc", "not valid base64"),
        ("!!!!", "not valid base64"),
        (b64(img()).replace("+", "-").replace("/", "_") + "-_", "not valid base64"),
        (b64(img())[:40] + "\n" + b64(img())[40:], "not valid base64"),
        (b64(img()).rstrip("="), "not valid base64"),
        ("", "image data is empty"),
        (b64(b"hello world, not an image"), "not PNG, JPEG, GIF or WebP"),
        (b64(b"BM" + b"\0" * 64), "not PNG, JPEG, GIF or WebP"),
        ("data:image/png,rawbytes", "data URL image must be base64"),
    ],
)
def test_bad_base64_and_non_images_are_bad_image(data: str, needle: str) -> None:
    e = refused("step", {"text": "x", "images": [{"data": data}]})
    assert e.reason == "bad_image" and needle in e.message and "images[0]" in e.message, e.message


def test_bad_mime_and_non_string_data() -> None:
    e = refused("step", {"text": "x", "images": [{"data": b64(img()), "mime": "text/html"}]})
    assert e.reason == "bad_image" and "not an image type" in e.message
    e = refused("step", {"text": "x", "images": [{"data": 12}]})
    assert e.reason == "invalid" and "images[0].data" in e.message


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ("/etc/passwd", "looks like a file path"),
        # valid base64 by accident: decoded, not an image, still a path
        ("/etc/shadow1", "looks like a file path"),
        ("../../secrets/frame.png", "looks like a file path"),
        ("~/frame.jpg", "looks like a file path"),
        ("frame_0001.png", "looks like a file path"),
        ("C:\\Users\\me\\frame.png", "looks like a file path"),
        ("file:///etc/passwd", "is a URL"),
        ("http://127.0.0.1:9/secret", "is a URL"),
        ("https://example.com/frame.png", "is a URL"),
        ("s3://bucket/frame.png", "is a URL"),
    ],
)
def test_paths_and_urls_are_refused_and_nothing_is_read_or_fetched(
    data: str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def forbidden(*a: object, **k: object) -> None:
        raise AssertionError(f"tried to read or fetch {a!r}")

    monkeypatch.setattr(builtins, "open", forbidden)
    monkeypatch.setattr(Path, "read_bytes", forbidden)
    monkeypatch.setattr(Path, "open", forbidden)
    monkeypatch.setattr(urllib.request, "urlopen", forbidden)
    monkeypatch.setattr(socket.socket, "connect", forbidden)
    for images in ([data], [{"data": data}], [{"data": data, "mime": "image/png"}]):
        e = refused("step", {"text": "x", "images": images})
        assert e.reason == "bad_image" and needle in e.message and "inline" in e.message, e.message
    e = refused("start", {"task": "t", "images": [data]})
    assert e.reason == "bad_image" and needle in e.message


def test_oversize_payload_is_refused_before_parsing() -> None:
    e = refused("step", b"{" * 2000, max_payload=1000)
    assert e.reason == "payload_too_large" and "2000 bytes, over the limit of 1000" in e.message
    assert decode("step", {"text": "x"}, max_payload=1000).text == "x"


def test_image_size_limit_from_argument_context_and_module_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    big = img(w=200, h=200)
    payload = {"text": "x", "images": [b64(big)]}
    e = refused("step", payload, max_image_bytes=len(big) - 1)
    assert e.reason == "bad_image" and "over the limit" in e.message
    assert decode("step", payload, max_image_bytes=len(big)).images[0].decoded() == big
    with pytest.raises(ValueError, match="over the limit of 10"):
        ImageIn.model_validate(b64(big), context={"max_image_bytes": 10})
    # The module default applies when no context names a limit (read at validation time by the input
    # models).
    monkeypatch.setattr(_inputs, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(ValueError, match="over the limit of 10"):
        ImageIn.model_validate(b64(big))
    # A huge string is refused on its length, before any decoding.
    with pytest.raises(ValueError, match="about 7500 bytes"):
        ImageIn.model_validate("A" * 10_000)


@pytest.mark.parametrize(
    "policy",
    [{"abort_belw": 0.1}, {"abort_below": 0.1, "temperature": 1, "x": 2}],
)
def test_unknown_policy_keys_name_the_known_ones(policy: dict[str, Any]) -> None:
    e = refused("start", {"task": "t", "policy": policy})
    assert e.reason == "invalid" and "unknown policy key" in e.message
    assert (
        "known keys: abort_below, resample_below, min_steps, patience, regression, max_uncertainty"
    ) in e.message


@pytest.mark.parametrize(
    ("policy", "needle"),
    [
        ({"abort_below": 2}, "use a number in [0, 1]"),
        ({"patience": 0}, "use an integer >= 1"),
        ({"patience": None}, "patience"),
        ({"min_steps": -1}, "min_steps"),
        ({"abort_below": True}, "policy abort_below=True: use a number in [0, 1]"),
        ({"compare": 1}, "policy compare=1: use true or false"),
        ({"abort_below": "0.2"}, "abort_below='0.2': use a number in [0, 1], or \"auto\""),
        ([0.2], "policy: Input should be a valid dictionary"),
    ],
)
def test_policy_values_are_checked(policy: Any, needle: str) -> None:
    e = refused("start", {"task": "t", "policy": policy})
    assert e.reason == "invalid" and needle in e.message, e.message


def test_policy_null_turns_a_signal_off_and_integral_floats_are_fine() -> None:
    start = decode("start", {"task": "t", "policy": {"abort_below": None, "patience": 4.0}})
    pol = start.resolved_policy(Policy(abort_below=0.3))
    assert pol.abort_below is None and pol.patience == 4 and isinstance(pol.patience, int)


@pytest.mark.parametrize(
    "name",
    [
        "criteria/robot.md",
        "robot.md",
        "rubric.json",
        "x.yaml",
        "x.yml",
        "/etc/passwd",
        "../criteria/progress",
        "..\\x",
        "~x",
    ],
)
def test_criteria_paths_are_refused(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    read: list[object] = []
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read.append(self) or "")
    e = refused("start", {"task": "t", "criteria": name})
    assert (
        e.reason == "invalid"
        and "looks like a file path" in e.message
        and "bundled name" in e.message
    )
    assert read == []


def test_criteria_file_that_exists_is_still_not_read(tmp_path: Path) -> None:
    f = tmp_path / "mine.md"
    f.write_text("## a\nis it done\n")
    e = refused("start", {"task": "t", "criteria": str(f)})
    assert "looks like a file path" in e.message


@pytest.mark.parametrize(
    ("criteria", "needle"),
    [
        ("nope", "no bundled criteria named 'nope'; use one of"),
        (5, "criteria must be a bundled name"),
        (True, "criteria must be a bundled name"),
        ({"a": 1}, "criteria as a dict is {name: description}"),
        ([], "criteria"),
        ([{"name": "a"}], "lacks 'description'"),
        ([{"type": "mystery"}], "has type 'mystery'"),
        (
            [{"type": "composite", "members": [{"type": "answer_match"}], "min_confidence": None}],
            "cannot be loaded",
        ),
        ([{"name": "a", "description": "x", "weight": -1}], "weights must be finite"),
    ],
)
def test_criteria_that_do_not_load_say_why(criteria: Any, needle: str) -> None:
    e = refused("start", {"task": "t", "criteria": criteria})
    assert (
        e.reason == "invalid" and e.message.startswith("start: criteria") and needle in e.message
    ), e.message


@pytest.mark.parametrize(
    ("labels", "needle"),
    [
        ({"1a": "x"}, "label name '1a' is not allowed"),
        ({"a-b": "x"}, "label name 'a-b' is not allowed"),
        ({"a" * 65: "x"}, "is not allowed"),
        ({"__name__": "x"}, "reserved"),
        ({"a": 1}, "has a integer value"),
        ({"a": "x" * 257}, "over the limit of 256"),
        (["a"], "labels: Input should be a valid dictionary"),
    ],
)
def test_labels_are_bounded(labels: Any, needle: str) -> None:
    e = refused("start", {"task": "t", "labels": labels})
    assert e.reason == "invalid" and needle in e.message, e.message


def test_meta_is_bounded_in_size_and_depth() -> None:
    e = refused("step", {"text": "x", "meta": {"blob": "a" * 70_000}})
    assert "over the limit of 65536" in e.message
    deep: Any = 1
    for _ in range(20):
        deep = [deep]
    assert (
        "nested more than 16 levels" in refused("step", {"text": "x", "meta": {"d": deep}}).message
    )
    assert (
        "numbers must be finite" in refused("step", b'{"text": "x", "meta": {"v": 1e999}}').message
    )


@pytest.mark.parametrize(
    "bad",
    [
        "agents//step",
        "agents/a+b/step",
        "agents/#/step",
        "agents/a\x00b/step",
        "agents/" + "a" * 129 + "/step",
        "agents/a b/step",
        "agents/é/step",
        "agents/_errors/step",
        "agents/../step",
        "agents/./step",
        "other/r1/step",
        "agentsx/r1/step",
        "agents/r1",
        "agents/r1/step/extra",
        "agents/a/b/step",
        "agents/r1/progress",
        "agents/_errors/x",
        "",
    ],
)
def test_bad_topics_and_run_ids_are_bad_topic(bad: str) -> None:
    with pytest.raises(TopicError):
        parse_topic(bad)
    with pytest.raises(EventError) as info:
        decode_event(bad, b'{"text": "x"}')
    assert info.value.reason == "bad_topic" and info.value.run_id is None
    out = info.value.to_out(bad)
    assert out.run_id is None and out.reason == "bad_topic" and len(out.topic) <= 515


@pytest.mark.parametrize(
    ("bad", "hint"),
    [
        ("agents/run-3/steps", "publish to agents/run-3/step"),
        ("agents/run-3/STEP", "publish to agents/run-3/step"),
        ("agents/run-3/begin", "publish to agents/run-3/<start|step|end>"),
        ("agents/run-3/", "publish to agents/run-3/<start|step|end>"),
    ],
)
def test_a_misspelt_kind_is_unknown_topic_naming_the_topic_and_the_kinds(
    bad: str, hint: str
) -> None:
    with pytest.raises(EventError) as info:
        decode_event(bad, b'{"text": "x"}')
    e = info.value
    assert e.reason == "unknown_topic" and e.run_id is None  # reported on agents/_errors
    assert e.message.startswith(
        f"unknown topic {bad!r}: the monitor reads only agents/<run_id>/start, step and end"
    )
    assert e.message.endswith(hint)
    with pytest.raises(TopicError) as topic_error:
        parse_topic(bad)
    assert topic_error.value.reason == "unknown_topic"


def test_the_monitors_own_topics_are_outputs_and_inputs_are_not() -> None:
    t = ev.Topics("lab/agents")
    assert t.subscription == "lab/agents/+/+"
    outputs = [
        "lab/agents/r1/progress",
        "lab/agents/r1/signal",
        "lab/agents/r1/error",
        "lab/agents/_errors",
    ]
    outputs += ["lab/agents/_groups/g1/ranking", "lab/agents/_groups/g1"]
    assert [o for o in outputs if not t.is_output(o)] == []
    others = [
        "lab/agents/r1/step",
        "lab/agents/r1/steps",
        "lab/agents/_sneaky/step",
        "agents/r1/progress",
    ]
    others += ["lab/agents/r1/progress/x", "lab/agentsx/r1/progress", "lab/agents/progress"]
    assert [o for o in others if t.is_output(o)] == []


def test_topic_helpers() -> None:
    assert parse_topic("agents/run-1.a:b_c/start") == ("run-1.a:b_c", "start")
    assert parse_topic("lab/agents/r9/end", prefix="lab/agents") == ("r9", "end")
    assert check_run_id("a" * 128) == "a" * 128
    assert topic("agents", "r1", "signal") == "agents/r1/signal"
    assert topic("lab/x", "r1", "step") == "lab/x/r1/step"
    assert ev.errors_topic() == "agents/_errors"
    assert ev.input_filters("lab") == ["lab/+/start", "lab/+/step", "lab/+/end"]
    for args in [
        ("agents", "r/1", "step"),
        ("agents", "r1", "nonsense"),
        ("agents/+", "r1", "step"),
        ("", "r1", "step"),
    ]:
        with pytest.raises(TopicError):
            topic(*args)
    with pytest.raises(TopicError, match="not under"):
        parse_topic("agents/r1/step", prefix="lab")
    with pytest.raises(TopicError, match="prefix"):
        parse_topic("agents/r1/step", prefix="agents/")


def test_error_event_carries_run_id_for_per_run_error_topic() -> None:
    e = refused("step", b"{")
    out = e.to_out("agents/r1/step")
    assert out == ErrorOut(run_id="r1", topic="agents/r1/step", reason="bad_json", error=e.message)
    assert json.loads(out.to_payload()) == out.model_dump()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["start", "step", "end"]),
    payload=st.one_of(
        st.binary(max_size=300),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats(allow_nan=False)
            | st.text(max_size=20),
            lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
            max_leaves=20,
        ).map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries(
            {},
            optional={
                "task": st.one_of(st.text(max_size=10), st.integers()),
                "text": st.one_of(st.text(max_size=10), st.none()),
                "index": st.one_of(st.integers(), st.text(max_size=3)),
                "images": st.lists(
                    st.one_of(st.text(max_size=12), st.binary(max_size=12).map(b64)), max_size=2
                ),
                "criteria": st.one_of(
                    st.text(max_size=12), st.lists(st.text(max_size=5), max_size=2)
                ),
                "policy": st.dictionaries(
                    st.sampled_from(["abort_below", "patience", "zzz"]), st.floats(), max_size=2
                ),
                "outcome": st.one_of(st.text(max_size=8), st.floats(allow_nan=False)),
            },
        ).map(lambda d: json.dumps(d).encode()),
    ),
)
def test_garbage_only_ever_raises_event_error(kind: str, payload: bytes) -> None:
    try:
        run_id, model = decode_event(f"agents/r1/{kind}", payload)
    except EventError as e:
        assert e.reason in ("payload_too_large", "bad_json", "invalid", "bad_image") and e.message
        ErrorOut(run_id=e.run_id, topic="t", reason=e.reason, error=e.message)
    else:
        assert run_id == "r1" and isinstance(model, _inputs.INPUT_MODELS[kind])


# -- outputs --


async def test_progress_out_from_a_real_progress() -> None:
    judge = FakeJudge()
    rubric = load_criteria({"done": "is it done", "tidy": "is it tidy"})
    steps = [Step(index=i, text=f"step {i}") for i in (1, 2)]
    p = await score_prefix("task", steps, judge=judge, rubric=rubric, coalesced=2)
    out = ProgressOut.from_progress(p, run_id="r1")
    assert out.run_id == "r1" and out.step == 2 and out.ok and out.score == pytest.approx(2 / 19)
    assert set(out.criteria) == {"done", "tidy"} and out.criteria["done"].weight == pytest.approx(
        0.5
    )
    assert (
        out.coalesced == 2
        and out.rubric == rubric.hash
        and out.model == "fake-1"
        and not out.degraded
    )
    assert out.tokens.input == p.usage.input_tokens > 0 and out.tokens.output == 2
    wire = json.loads(out.to_payload())
    # The wire shape is Progress.to_json, with the run id the caller gave.
    form = p.to_json()
    for key in (
        "step",
        "score",
        "uncertainty",
        "ok",
        "error",
        "reason",
        "coalesced",
        "tokens",
        "calls_saved",
        "rubric",
    ):
        assert wire[key] == form[key], key
    assert wire["criteria"]["done"] == form["criteria"]["done"]
    # A result that is not a run's final one, sent again with its verdict when the run ends (those
    # two fields).
    assert wire == {**form, "run_id": "r1", "final": False, "verdict": None}
    assert ProgressOut.model_validate_json(out.to_payload()) == out


def test_progress_out_for_a_failed_judge_call_is_null_scored_and_degraded() -> None:
    p = Progress(
        step=4,
        score=None,
        uncertainty=None,
        criteria={},
        ok=False,
        error="timed out",
        reason="timeout",
    )
    out = ProgressOut.from_progress(dataclasses.replace(p, degraded=True), run_id="r1")
    wire = json.loads(out.to_payload())
    assert (
        wire["score"] is None
        and wire["ok"] is False
        and wire["reason"] == "timeout"
        and wire["degraded"] is True
    )


def test_progress_out_never_sends_invalid_json() -> None:
    p = Progress(step=1, score=math.nan, uncertainty=math.inf, criteria={}, ok=True)
    wire = json.loads(ProgressOut.from_progress(p, run_id="r1").to_payload())
    assert wire["score"] is None and wire["uncertainty"] is None


def test_signal_out_from_a_policy_decision() -> None:
    pol = Policy(abort_below=0.2, min_steps=0, patience=1)
    state = PolicyState(pol)
    state.observe(Progress(step=1, score=0.6, uncertainty=0.0, criteria={}, ok=True))
    d = state.observe(Progress(step=2, score=0.1, uncertainty=0.0, criteria={}, ok=True))
    out = SignalOut.from_decision("r1", d, pol)
    assert (out.signal, out.step, out.score, out.best_step) == ("abort", 2, 0.1, 1)
    assert out.policy["abort_below"] == 0.2 and "score below 0.2" in out.reason
    assert SignalOut.model_validate_json(out.to_payload()) == out


def test_output_models_validate_run_id_and_reason() -> None:
    with pytest.raises(ValueError):
        SignalOut(run_id="a/b", signal="abort", reason="x", step=1)
    with pytest.raises(ValueError):
        ErrorOut(topic="t", reason="Bad Reason", error="x")
    # Clients tolerate fields a newer monitor adds.
    assert (
        SignalOut.model_validate(
            {"run_id": "r", "signal": "continue", "reason": "", "step": 0, "new": 1}
        ).step
        == 0
    )


# -- schemas --


def test_committed_schemas_equal_freshly_generated_ones() -> None:
    assert ev.stale_schemas(REPO / "schemas") == [], "run: agent-monitor schemas --write schemas/"


def test_write_and_check_schemas(tmp_path: Path) -> None:
    assert cli_main(["schemas", "--check", str(tmp_path)]) == 1
    written = ev.write_schemas(tmp_path)
    assert sorted(p.name for p in written) == sorted(f"{k}.schema.json" for k in SCHEMA_MODELS)
    assert cli_main(["schemas", "--check", str(tmp_path)]) == 0
    (tmp_path / "old.schema.json").write_text("{}")
    assert ev.stale_schemas(tmp_path) == ["old.schema.json"]
    for p in written:
        schema = json.loads(p.read_text())
        assert (
            schema["$schema"].startswith("https://json-schema.org/") and schema["type"] == "object"
        )
    step = json.loads((tmp_path / "step.schema.json").read_text())
    assert step["required"] == ["text"]
    assert {"type": "string", "contentEncoding": "base64"}.items() <= step["$defs"]["ImageIn"][
        "anyOf"
    ][0].items()
    start = json.loads((tmp_path / "start.schema.json").read_text())
    assert start["properties"]["policy"]["propertyNames"]["enum"] == list(ev.POLICY_KEYS)

"""Step extractors on real-looking agent output; the registry and config building."""

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from agent_monitor.extractors import (
    EXTRACTORS,
    Boxed,
    LastNumber,
    Pipeline,
    RegexCapture,
    StripReasoning,
    StripSpecialTokens,
    Truncate,
    build_extractor,
    build_extractors,
    register_extractor,
)

# Shapes from the recorded Terminal-Bench runs: mini-swe-agent reports tool output as JSON
# (line breaks escaped), Terminus 2 as raw terminal text.
JSON_TRACEBACK = (
    '{\n  "returncode": 1,\n  "output": "Traceback (most recent call last):\\n  File '
    '\\"\\u003cstring\\u003e\\", '
    "line 2, in \\u003cmodule\\u003e\\n    import torch\\nModuleNotFoundError: No module "
    'named \\u0027torch\\u0027\\n"\n}'
)
TERMINAL_TRACEBACK = (
    "New Terminal Output:\n\n"
    'root@7f53072e:/app# python3 -c "import torch"\n'
    "Traceback (most recent call last):\n"
    '  File "<string>", line 1, in <module>\n'
    "    import torch\n"
    "ModuleNotFoundError: No module named 'torch'\n"
    "root@7f53072e:/app#   \n"
)


# --- StripReasoning ---


def test_strip_reasoning_removes_think_and_thinking_blocks_any_case_multiline() -> None:
    text = (
        "<think>\nThe user wants torch. Let me check\nif it is installed.\n</think>\n"
        "I will check whether torch is installed.\n<THINKING>pip may be "
        "offline</Thinking>\n$ python3 -c 'import torch'"
    )
    assert StripReasoning()(text) == (
        "I will check whether torch is installed.\n\n$ python3 -c 'import torch'"
    )


def test_strip_reasoning_drops_an_unclosed_trailing_block() -> None:
    assert (
        StripReasoning()("Plan: run the tests.\n<think>maybe I should first look at")
        == "Plan: run the tests."
    )


def test_strip_reasoning_drops_text_before_an_orphan_closing_tag() -> None:
    # DeepSeek-R1 / Qwen3 templates open <think> in the prompt, so the output starts inside the
    # block.
    assert StripReasoning()("okay so the file is missing\n</think>\n\nls -la /app") == "ls -la /app"


def test_strip_reasoning_leaves_text_without_blocks_and_other_tags_alone() -> None:
    text = "<thinker>not a block</thinker> and a <b>tag</b>"
    assert StripReasoning()(text) == text
    assert StripReasoning()(TERMINAL_TRACEBACK) == TERMINAL_TRACEBACK.strip()


def test_strip_reasoning_custom_tags() -> None:
    assert (
        StripReasoning(tags=("reflection",))("a<reflection>x</reflection>b<think>y</think>")
        == "ab<think>y</think>"
    )
    with pytest.raises(ValueError, match="tags must be a non-empty list"):
        StripReasoning(tags=())


# --- StripSpecialTokens ---


def test_strip_special_tokens_chatml_llama_gemma_deepseek_and_sentencepiece() -> None:
    text = (
        "<|im_start|>assistant\nLet me run the tests.<|im_end|>\n"
        "<|start_header_id|>assistant<|end_header_id|>\n\nDone.<|eot_id|>\n"
        "<start_of_turn>model\nOK<end_of_turn>\n"
        "<s>[INST] hi [/INST] there</s>\n"
        "<\uff5cAssistant\uff5c>answer<\uff5cend\u2581of\u2581sentence\uff5c>"
    )
    assert StripSpecialTokens()(text) == (
        "assistant\nLet me run the tests.\nassistant\n\nDone.\nmodel\nOK\n hi  there\nanswer"
    )


def test_strip_special_tokens_tidies_whitespace_but_keeps_indentation() -> None:
    out = StripSpecialTokens()(TERMINAL_TRACEBACK + "\n\n\n\n\n<|im_end|>")
    assert out.endswith("ModuleNotFoundError: No module named 'torch'\nroot@7f53072e:/app#")
    assert '  File "<string>", line 1, in <module>\n    import torch\n' in out
    assert (
        "\n\n\n" not in StripSpecialTokens()("a\n\n\n\n\nb")
        and StripSpecialTokens()("a\n\n\n\nb") == "a\n\nb"
    )
    assert StripSpecialTokens()("a <b>bold</b> a|b") == "a <b>bold</b> a|b"


# --- Truncate ---


def test_truncate_keeps_head_and_tail_with_a_marker() -> None:
    text = "".join(f"line {i:03d}\n" for i in range(100))  # 900 characters
    assert (
        Truncate(max_chars=100)(text) == text[:50] + "\n[... 800 characters cut ...]\n" + text[-50:]
    )


def test_truncate_head_share_and_short_text() -> None:
    assert Truncate(max_chars=10, head_share=0.0)("0123456789abcdef") == (
        "\n[... 6 characters cut ...]\n6789abcdef"
    )
    assert Truncate(max_chars=10, head_share=1.0)("0123456789abcdef") == (
        "0123456789\n[... 6 characters cut ...]\n"
    )
    assert Truncate(max_chars=10, head_share=0.3)("0123456789abcdef") == (
        "012\n[... 6 characters cut ...]\n9abcdef"
    )
    assert Truncate(max_chars=16)("0123456789abcdef") == "0123456789abcdef"
    assert Truncate()(JSON_TRACEBACK) == JSON_TRACEBACK


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_chars": 0}, "max_chars must be an integer"),
        ({"max_chars": "2000"}, "max_chars must be an integer"),
        ({"max_chars": 10.5}, "max_chars must be an integer"),
        ({"head_share": 1.5}, "head_share must be a number in"),
        ({"head_share": True}, "head_share must be a number in"),
    ],
)
def test_truncate_rejects_bad_budgets(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Truncate(**params)  # type: ignore[arg-type]


# --- RegexCapture ---


def test_regex_capture_first_match_group_and_all() -> None:
    text = (
        "FAILED tests/test_api.py::test_get - KeyError: 'id'\nFAILED "
        "tests/test_api.py::test_put - assert 404 == 200"
    )
    assert RegexCapture(r"FAILED (\S+)")(text) == "tests/test_api.py::test_get"
    assert (
        RegexCapture(r"FAILED (\S+)", all=True)(text)
        == "tests/test_api.py::test_get\ntests/test_api.py::test_put"
    )
    assert RegexCapture(r"FAILED \S+ - (?P<why>\w+)", group="why")(text) == "KeyError"
    assert RegexCapture(r"(?i)^failed", group=0)(text) == "FAILED"


def test_regex_capture_no_match_is_empty_not_the_input() -> None:
    assert RegexCapture(r"(?im)^final answer:\s*(.+)$")(TERMINAL_TRACEBACK) == ""
    assert RegexCapture(r"(?im)^final answer:\s*(.+)$", all=True)(TERMINAL_TRACEBACK) == ""
    # An optional group that took no part in the match is no capture.
    assert RegexCapture(r"No module named (')?", all=True)(TERMINAL_TRACEBACK) == "'"
    assert RegexCapture(r"No module named (x)?")(TERMINAL_TRACEBACK) == ""


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"pattern": "(unclosed"}, "invalid regular expression '\\(unclosed'"),
        ({"pattern": r"\d+"}, "has 0 group\\(s\\), so group 1 does not exist"),
        ({"pattern": r"(\d+)", "group": 2}, "group 2 does not exist"),
        ({"pattern": r"(?P<n>\d+)", "group": "m"}, "no group named 'm'"),
        ({"pattern": 5}, "pattern must be a string"),
        ({"pattern": r"(\d)", "all": "yes"}, "all must be true or false"),
    ],
)
def test_regex_capture_rejects_bad_patterns_and_groups(
    params: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        RegexCapture(**params)  # type: ignore[arg-type]


# --- LastNumber and Boxed ---


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The model predicts digit 2.\nprediction.txt content: [2]", "2"),
        ("Accuracy: 97.5% on 10,000 images", "10000"),
        ("loss went from 2.31 to -0.125", "-0.125"),
        ("Total: 1,234,567.89 bytes", "1234567.89"),
        ("learning rate 3e-4", "3e-4"),
        ("delta +7", "7"),
        ("temperature \u22123 C", "-3"),
        ("pages 1-3", "3"),  # a range, not minus three
        ("[1,2,3]", "3"),  # a list, not one thousand-separated number
        ("x2 and v1 and the 3rd", ""),
        ("exit code: -2\n--- stdout ---\n", "-2"),
        ("no digits here", ""),
        ("", ""),
    ],
)
def test_last_number(text: str, number: str) -> None:
    assert LastNumber()(text) == number


def test_last_number_in_a_traceback_is_the_line_number() -> None:
    assert LastNumber()(TERMINAL_TRACEBACK) == "1"


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"So the answer is \boxed{42}.", "42"),
        (r"First \boxed{1}, corrected: \boxed{ \frac{1}{2} }", r"\frac{1}{2}"),
        (r"\boxed{\{a, b\} \cup \{c\}}", r"\{a, b\} \cup \{c\}"),
        (r"\boxed {x^{2}}", "x^{2}"),
        (r"\fbox{7}", "7"),
        (r"\boxed{3} then a cut-off \boxed{\frac{1}{", "3"),
        (r"\boxed{unclosed", ""),
        ("no box: 42", ""),
    ],
)
def test_boxed(text: str, content: str) -> None:
    assert Boxed()(text) == content


# --- Pipeline and config ---


def test_pipeline_applies_in_order() -> None:
    text = "<think>the answer is \\boxed{1}</think>Final: \\boxed{12,345}<|im_end|>"
    assert Pipeline((StripReasoning(), Boxed(), LastNumber()))(text) == "12345"
    # order matters: no box left around "12345"
    assert Pipeline((LastNumber(), Boxed()))(text) == ""
    assert Pipeline()(text) == text
    assert Pipeline([str.upper, Truncate(4)]).extractors == (str.upper, Truncate(4))


def test_build_extractors_from_names_and_dicts() -> None:
    p = build_extractors(
        [
            "strip_reasoning",
            "strip_special_tokens",
            {"type": "truncate", "max_chars": 2000, "head_share": 0.25},
            {"type": "regex_capture", "pattern": r"(?m)^Answer: (.*)$"},
        ]
    )
    assert p.extractors == (
        StripReasoning(),
        StripSpecialTokens(),
        Truncate(2000, 0.25),
        RegexCapture(r"(?m)^Answer: (.*)$"),
    )
    assert p("<think>x</think>Answer: Paris<|im_end|>") == "Paris"
    assert build_extractors(None) == Pipeline() == build_extractors([])
    assert build_extractor(str.strip) is str.strip
    assert {
        "strip_reasoning",
        "strip_special_tokens",
        "truncate",
        "regex_capture",
        "last_number",
        "boxed",
    } <= set(EXTRACTORS)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            ["strip_thoughts"],
            r"extractors\[0\]: unknown extractor 'strip_thoughts'; known " r"extractors: boxed, ",
        ),
        (
            [{"max_chars": 10}],
            r"extractors\[0\]: extractor config .* needs a 'type' naming " r"one of: boxed",
        ),
        (
            ["boxed", {"type": "truncate", "max_char": 10}],
            r"extractors\[1\]: extractor 'truncate' does not take 'max_char'; its parameters "
            r"are: max_chars, head_share",
        ),
        (
            [{"type": "truncate", "max_chars": -1}],
            r"extractors\[0\]: truncate: max_chars must " r"be an integer",
        ),
        ([{"type": "regex_capture"}], r"extractor 'regex_capture': bad parameters \{\}: .*pattern"),
        ([3], "an extractor config item is a int; use a name or a dict with 'type'"),
        ("boxed", "extractors config must be a list, got 'boxed'; wrap a single item in a list"),
        ({"type": "boxed"}, "extractors config must be a list"),
    ],
)
def test_build_extractors_errors_say_what_is_wrong(spec: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_extractors(spec)  # type: ignore[arg-type]


@pytest.fixture
def clean_registry() -> Iterator[None]:
    before = dict(EXTRACTORS)
    yield
    EXTRACTORS.clear()
    EXTRACTORS.update(before)


@pytest.mark.usefixtures("clean_registry")
def test_a_users_own_extractor_is_one_decorator_away() -> None:
    @register_extractor("json_field")
    @dataclass(frozen=True)
    class JsonField:
        key: str = "output"

        def __call__(self, text: str) -> str:
            import json

            return str(json.loads(text)[self.key])

    p = build_extractors([{"type": "json_field"}, "last_number"])
    assert p(JSON_TRACEBACK) == "2"  # the line number in the decoded traceback
    assert build_extractors([{"type": "json_field", "key": "returncode"}])(JSON_TRACEBACK) == "1"
    # Registering the same type again is harmless; another type under a taken name is refused.
    register_extractor("json_field")(JsonField)
    with pytest.raises(
        ValueError,
        match="extractor name 'truncate' is already taken by Truncate; pick another name",
    ):
        register_extractor("truncate")(JsonField)
    with pytest.raises(ValueError, match="extractor name must be a non-empty string"):
        register_extractor("")

"""The tool-call parser (k3.infer.tool_calls): Kimi's section -> OpenAI tool calls, whole or streamed with the
text split anywhere; malformed sections stay plain content."""

import json
import random

import pytest

from k3.infer.tool_calls import ToolCall, ToolCallStream, parse_tool_calls

NAMES = {"get_weather", "now"}
B, E, CB, AB, CE = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
ONE = f'Let me look.{B}{CB}functions.get_weather:0{AB}{{"city": "Paris"}}{CE}{E}'
TWO = f'{B}{CB}functions.get_weather:2{AB} {{"city": "Lyon"}} {CE}\n{CB} now:3 {AB}{{}}{CE}{E}'
WEATHER = ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}')
MALFORMED = [
    f"x{B}{CB}functions.get_weather:0{AB}{{city: Paris}}{CE}{E}",  # arguments not JSON
    f"x{B}{CB}functions.get_weather:0{AB}[1, 2]{CE}{E}",  # not an object
    f"x{B}{CB}functions.rm_rf:0{AB}{{}}{CE}{E}",  # a function not offered
    f"x{B}{CB}functions.get_weather{AB}{{}}{CE}{E}",  # no index
    f"x{B}{E}",  # no call
    f"x{B}{CB}functions.now:0{AB}{{}}{CE} chatter {E}",  # text between the calls
    f'x{B}{CB}functions.get_weather:0{AB}{{"city": "Pa',  # cut by max_tokens
    f"x{B}{CB}functions.now:0{AB}{{}}{CE}",  # no section end
]


def test_plain_text_is_content():
    for text in ("", "hello", "a < b <| c <|tool", f"{CB}functions.now:0{AB}{{}}{CE}"):
        assert parse_tool_calls(text, NAMES) == (text, [])


def test_one_call_with_content_before():
    content, calls = parse_tool_calls(ONE, NAMES)
    assert content == "Let me look." and calls == [WEATHER]
    assert WEATHER.openai() == {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert json.loads(calls[0].openai()["function"]["arguments"]) == {"city": "Paris"}


def test_two_calls_whitespace_and_a_missing_prefix():
    content, calls = parse_tool_calls(TWO, NAMES)
    assert content is None
    assert calls == [
        ToolCall("functions.get_weather:2", "get_weather", '{"city": "Lyon"}'),
        ToolCall("functions.now:3", "now", "{}"),
    ]
    assert parse_tool_calls(TWO, NAMES, max_calls=1)[1] == calls[:1]  # parallel_tool_calls: false


def test_text_after_the_section_and_a_second_section_stay_content():
    content, calls = parse_tool_calls(ONE + " done" + TWO, NAMES)
    assert calls == [WEATHER] and content == "Let me look. done" + TWO


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_sections_stay_plain_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def streamed(text: str, cuts: list[int]) -> tuple[str, list, list[str]]:
    """(content, calls, each feed's released content) of ``text`` fed in the pieces ``cuts`` make."""
    stream, bounds = ToolCallStream(NAMES), [0, *cuts, len(text)]
    content, calls, released = "", [], []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        events = stream.feed(text[a:b], final=k == len(bounds) - 2)
        released.append("".join(e for e in events if isinstance(e, str)))
        content += released[-1]
        calls += [e for e in events if isinstance(e, ToolCall)]
    assert calls == stream.calls
    return content, calls, released


@pytest.mark.parametrize("text", [ONE, TWO, ONE + " done", "plain <| text <|tool_calls", *MALFORMED])
def test_streamed_equals_whole_wherever_the_text_is_split(text):
    whole_content, whole_calls = parse_tool_calls(text, NAMES)
    want = whole_content or ""
    for cut in range(len(text) + 1):  # every split in two
        assert streamed(text, [cut])[:2] == (want, whole_calls), cut
    assert streamed(text, list(range(1, len(text))))[:2] == (want, whole_calls)  # one character a piece
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        assert streamed(text, cuts)[:2] == (want, whole_calls), cuts


def test_stream_holds_only_what_may_begin_a_section():
    _, _, released = streamed(ONE, [len("Let me look.<|tool_c"), len(ONE) - 3])
    assert released == ["Let me look.", "", ""]  # "<|tool_c" may begin the section: held, then the section
    _, _, released = streamed("a <|x and more", [4, 5])
    assert released == ["a ", "<|x", " and more"]  # "<|x" cannot: released at once

"""The tool-call parser: every malformed shape is a format error with a precise message."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.parsing import CALL_EXAMPLES, COMPRESS, EXECUTE_ACTION, canonical_call, parse_tool_call
from memory.parsing import render_tool_call as call


def test_well_formed_call_after_thinking_text():
    parsed = parse_tool_call("I should look first.\n" + call("execute_action", {"action": "look"}))
    assert parsed.kind == "call" and parsed.name == "execute_action"
    assert parsed.arguments == {"action": "look"}
    assert not parsed.format_error


def test_no_call_is_not_a_format_error():
    parsed = parse_tool_call("I am thinking about the apple.")
    assert parsed.kind == "none" and not parsed.format_error


def test_call_inside_think_block_is_ignored():
    assert parse_tool_call("<think>" + call("finish", {}) + "</think> nothing").kind == "none"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('<tool_call>{"name": "finish", "arguments": {}}', "unclosed"),
        ('{"name": "finish"}</tool_call>', "without an opening"),
        ("<tool_call>{name: finish}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        (call("fly", {}), "unknown tool 'fly'"),
        (call("execute_action", {}), "missing the required argument 'action'"),
        (call("execute_action", {"action": 3}), "must be of type str"),
        (call("ReadExperience", {}), "'db_index'"),
        (call("CompressExperience", {"summary": "s"}), "'db_blocks'"),
        (call("finish", {}) + call("finish", {}), "2 tool calls"),
        ('<tool_call>{"name": "finish", "arguments": "nope"}</tool_call>', "not a JSON object"),
    ],
)
def test_malformed_calls_are_format_errors(text, fragment):
    parsed = parse_tool_call(text)
    assert parsed.kind == "malformed" and parsed.format_error
    assert fragment in parsed.error
    assert parsed.error.startswith("Format error:")


@pytest.mark.parametrize("name", sorted(CALL_EXAMPLES))
def test_each_format_hint_is_a_well_formed_call_of_its_tool(name):
    parsed = parse_tool_call(CALL_EXAMPLES[name])
    assert parsed.kind == "call" and parsed.name == name


def test_a_broken_call_is_shown_the_form_of_the_tool_it_names():
    """A CompressExperience call cut at the generation cap, or with invalid JSON, is answered with a
    CompressExperience call's shape (the policy repairs the call it tried), not with `look`."""
    cut = '<tool_call>{"name": "CompressExperience", "arguments": {"summary": "Progress: searching.'
    invalid = '<tool_call>{"name": "CompressExperience", "arguments": {"summary": "s", "db_blocks": [{]}}</tool_call>'
    for text in (cut, invalid):
        error = parse_tool_call(text).error
        assert error.endswith("Use exactly: " + CALL_EXAMPLES[COMPRESS])
    no_name = parse_tool_call('<tool_call>{"action": "look"</tool_call>').error
    assert no_name.endswith("Use exactly: " + CALL_EXAMPLES[EXECUTE_ACTION])


def test_arguments_as_json_string_are_accepted():
    text = '<tool_call>{"name": "ReadExperience", "arguments": "{\\"db_index\\": \\"a\\"}"}</tool_call>'
    assert parse_tool_call(text).arguments == {"db_index": "a"}


def test_a_call_named_after_an_archived_index_is_shown_the_read_of_it():
    """A weak policy calls a block by its index ({"name": "shop-2", ...}): the error gives the call that reads
    it; a name that is neither a tool nor an index, or an index where ReadExperience is not a tool, does not."""
    archive = {"shop-2"}
    error = parse_tool_call(call("shop-2", {"state": "2"}), archive=archive).error
    assert "'shop-2' is an archive index, not a tool" in error
    assert error.endswith("Use exactly: " + call("ReadExperience", {"db_index": "shop-2"}))
    assert "unknown tool 'fly'" in parse_tool_call(call("fly", {}), archive=archive).error
    no_read = parse_tool_call(call("shop-2", {}), tools=("execute_action", "finish"), archive=archive).error
    assert "unknown tool 'shop-2'" in no_read


def test_restricted_tool_set():
    parsed = parse_tool_call(call("ReadExperience", {"db_index": "a"}), tools=("execute_action", "finish"))
    assert parsed.format_error and "unknown tool" in parsed.error


def test_canonical_call_sorts_keys():
    assert canonical_call("t", {"b": 1, "a": 2}) == canonical_call("t", {"a": 2, "b": 1})


@settings(max_examples=2000, deadline=None)
@given(st.text())
def test_parser_never_crashes_on_random_text(text):
    parsed = parse_tool_call(text)
    assert parsed.kind in ("call", "none", "malformed")
    assert (parsed.error is not None) == (parsed.kind == "malformed")


@settings(max_examples=300, deadline=None)
@given(summary=st.lists(st.one_of(st.text(alphabet=st.characters(blacklist_categories=("Cs",))),
                                   st.sampled_from(["<tool_call>", "</tool_call>", "<think>", "</think>", "<"]))
                         ).map("".join),
       thought=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_a_rendered_call_parses_back_to_its_arguments(summary, thought):
    """The experts write their replies with render_tool_call (`call` here): whatever a summary holds (braces,
    quotes, newlines, the call and think tags), the parser reads back exactly the call that was written."""
    arguments = {"summary": summary, "db_blocks": [{"db_index": "facts", "db_content": summary}]}
    parsed = parse_tool_call(call(COMPRESS, arguments, thought.replace("<", "")))
    assert (parsed.kind, parsed.name, parsed.arguments) == ("call", COMPRESS, arguments)

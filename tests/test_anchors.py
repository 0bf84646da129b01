"""Anchor-mode extraction: verbatim spans, exact match first, then whitespace-collapsed."""

from memory.anchors import absent_anchors, extract_span, fill_content, line_end_after

CONTEXT = (
    "You arrive at fridge 1. The fridge 1 is closed.\n\n"
    "You open the fridge 1. In it, you see an apple 2,   a lettuce 1, and a tomato 3.\n\n"
    "You arrive at countertop 1. On the countertop 1, you see a knife 1."
)


def test_exact_span_is_verbatim_and_inclusive():
    span = extract_span(CONTEXT, "You open the fridge 1", "lettuce 1", "tomato 3.")
    assert span == "You open the fridge 1. In it, you see an apple 2,   a lettuce 1, and a tomato 3."


def test_whitespace_collapsed_match_returns_original_text():
    span = extract_span(CONTEXT, "apple 2, a   lettuce", "lettuce", "and a\ntomato 3")
    assert span == "apple 2,   a lettuce 1, and a tomato 3"


def test_mid_anchor_must_be_inside_span():
    assert extract_span(CONTEXT, "You open", "knife 1", "tomato 3.") is None
    # The span may extend to a later end anchor to contain mid.
    assert extract_span(CONTEXT, "fridge 1", "countertop", "1.").startswith("fridge 1")


def test_missing_anchor_is_none():
    assert extract_span(CONTEXT, "You open", "apple", "banana") is None
    assert extract_span(CONTEXT, "", "apple", "tomato") is None


def test_fill_content_placeholder_or_append():
    assert fill_content("Fridge: {{EXTRACT}} (step 3)", "apple 2") == "Fridge: apple 2 (step 3)"
    assert fill_content("Fridge contents", "apple 2") == "Fridge contents\napple 2"
    assert fill_content(None, "apple 2") == "apple 2"


def test_a_list_of_texts_is_searched_one_by_one_and_no_span_crosses_two():
    pieces = CONTEXT.split("\n\n")
    assert extract_span(pieces, "You open", "lettuce", "tomato 3.") == pieces[1][: pieces[1].index("tomato 3.") + 9]
    # In the joined context the span runs from fridge 1's arrival into the next observation; per piece it cannot.
    assert extract_span(CONTEXT, "You arrive at fridge", "lettuce", "tomato 3.") is not None
    assert extract_span(pieces, "You arrive at fridge", "lettuce", "tomato 3.") is None
    # An exact match in a later piece wins over a whitespace-collapsed match in an earlier one.
    assert extract_span(["an apple  2 here", "an apple 2 here"], "an apple 2", "apple", "here") == "an apple 2 here"
    assert extract_span(["an apple  2 here"], "an apple 2", "apple", "here") == "an apple  2 here"


def test_absent_anchors_names_only_the_anchors_found_nowhere():
    """What a rejected anchor block's error names: an anchor that occurs in no searched text (exactly or with
    whitespace collapsed); anchors that occur, even in different texts, are not named."""
    pieces = CONTEXT.split("\n\n")
    anchors = {"start_anchor": "You arrive at fridge", "mid_anchor": "lettuce", "end_anchor": "tomato 3."}
    assert extract_span(pieces, *anchors.values()) is None and absent_anchors(pieces, anchors) == []
    wrong = dict(anchors, mid_anchor="a zebra", end_anchor="tomato  3.")  # extra space: found once collapsed
    assert absent_anchors(pieces, wrong) == ["mid_anchor"]
    assert absent_anchors(CONTEXT, dict(anchors, start_anchor="x1", end_anchor="x2")) == ["start_anchor", "end_anchor"]


def test_line_end_after_gives_the_end_of_the_line_after_start_and_mid():
    """The hint of a rejected anchor block: where start_anchor is followed by mid_anchor, how mid's line ends."""
    pieces = CONTEXT.split("\n\n")
    assert line_end_after(pieces, "You open", "lettuce") == "a tomato 3."
    assert line_end_after(CONTEXT, "You open", "lettuce", words=2) == "tomato 3."  # scope "context": one string
    assert line_end_after(pieces, "lettuce", "You open") is None  # mid only before start: no such line
    assert line_end_after(pieces, "You open", "zebra") is None and line_end_after(pieces, "", "apple") is None

"""Qwen3-Thinking replies (issue 25, 6): the chat template opens <think> in the prompt, so a reply is
reasoning, </think>, then the answer. A <tool_call> the model mentions while reasoning is not a call;
the reasoning stays in the trajectory and in the trained tokens."""

import copy
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json

import pytest

from common.config import load_config
from envs.data import resolve_game
from memexrl.cli import replay
from memory.context import ChatRenderer
from memory.parsing import parse_tool_call

# The generation prompt of Qwen3-*-Thinking-2507's template: "<|im_start|>assistant\n<think>\n".
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
LOOK = '<tool_call>{"name": "execute_action", "arguments": {"action": "look"}}</tool_call>'
MENTIONED = '<tool_call>{"name": "ReadExperience", "arguments": {"db_index": "room"}}</tool_call>'
REPLY = f"The room is unknown. I could call {MENTIONED}, but nothing is archived yet.\n</think>\n\n{LOOK}"


def test_the_call_is_read_after_the_last_think_close():
    assert parse_tool_call(REPLY).format_error  # without the setting: two calls
    call = parse_tool_call(REPLY, thinking=True)
    assert call.kind == "call" and call.name == "execute_action" and call.arguments == {"action": "look"}
    assert parse_tool_call("still reasoning about " + LOOK, thinking=True).kind == "none"  # no </think> yet
    assert parse_tool_call("a</think>b</think>" + LOOK, thinking=True).name == "execute_action"


def test_a_template_that_opens_think_is_detected(smol_tokenizer):
    thinking = copy.deepcopy(smol_tokenizer)
    thinking.chat_template = THINKING_TEMPLATE
    assert ChatRenderer(thinking).thinking and not ChatRenderer(smol_tokenizer).thinking
    assert ChatRenderer(smol_tokenizer, thinking=True).thinking


@pytest.mark.parametrize("setting, is_format_error", [("always", False), ("never", True)])
def test_a_thinking_reply_plays_its_answer_and_keeps_its_reasoning(alfworld_data, smol_tokenizer, setting,
                                                                   is_format_error):
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", f"model.thinking={setting}"])
    out = replay(str(resolve_game("valid_seen:1", alfworld_data)), [REPLY], cfg, smol_tokenizer)
    (step,) = out["steps"]
    assert step["format_error"] is is_format_error and step["assistant"] == REPLY
    if not is_format_error:
        assert step["tool"] == "execute_action" and step["observation"].startswith("You are in the middle of a room")
    assert json.dumps(out)  # the reasoning is in the trajectory JSON, and trained with the reply's tokens

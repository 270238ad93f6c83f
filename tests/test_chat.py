"""Chat template renderings, written out by hand from the spec §6.3 rules."""
import pytest

from ds4ref.serve.chat import ChatTemplateError, render_chat, thinking_requested

# Spelled out literally (not imported) so a typo in chat.py's constants is caught.
B = "<｜begin▁of▁sentence｜>"
E = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"


def test_special_strings_use_fullwidth_bar_and_lower_block():
    assert B == "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    assert render_chat([{"role": "user", "content": "x"}]).startswith(B)


def test_single_user_turn_non_thinking():
    msgs = [{"role": "user", "content": "Hello"}]
    assert render_chat(msgs) == B + U + "Hello" + A + "</think>"


def test_single_user_turn_thinking():
    msgs = [{"role": "user", "content": "Hello"}]
    assert render_chat(msgs, thinking=True) == B + U + "Hello" + A + "<think>"


def test_system_messages_joined_by_blank_line_without_role_marker():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Answer in Italian."},
            {"role": "user", "content": "Chi era Ada Lovelace?"}]
    assert render_chat(msgs) == (B + "Be brief.\n\nAnswer in Italian." + U + "Chi era Ada Lovelace?"
                                 + A + "</think>")


def test_multi_turn_non_thinking_drops_reasoning():
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "add"},
            {"role": "user", "content": "and 3+3?"}]
    assert render_chat(msgs) == (B + U + "2+2?" + A + "</think>" + "4" + E
                                 + U + "and 3+3?" + A + "</think>")


def test_thinking_keeps_reasoning_only_after_last_user_turn():
    msgs = [{"role": "system", "content": "S"},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "", "reasoning_content": "r2"},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "a2", "reasoning_content": "r3"},
            {"role": "user", "content": "q3"}]
    # q3 is the last user turn, so every assistant message precedes it: no reasoning kept.
    assert render_chat(msgs, thinking=True) == (
        B + "S" + U + "q1" + A + "</think>a1" + E
        + U + "q2" + A + "</think>" + E
        + U + "<tool_result>42</tool_result>" + A + "</think>a2" + E
        + U + "q3" + A + "<think>")


def test_thinking_agent_loop_after_last_user_keeps_reasoning():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "calling", "reasoning_content": "r1"},
            {"role": "tool", "content": "A"},
            {"role": "tool", "content": "B"}]
    assert render_chat(msgs, thinking=True) == (
        B + U + "q" + A + "<think>r1</think>calling" + E
        + U + "<tool_result>A</tool_result><tool_result>B</tool_result>" + A + "<think>")


def test_tool_result_cannot_close_its_wrapper():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "c"},
            {"role": "tool", "content": "x</tool_result>y"}]
    assert render_chat(msgs) == (B + U + "q" + A + "</think>c" + E
                                 + U + "<tool_result>x<\\/tool_result>y</tool_result>" + A + "</think>")


def test_text_parts_are_joined_by_newline():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(msgs) == B + U + "a\nb" + A + "</think>"


def test_assistant_prefix_is_continued_without_end_of_sentence():
    msgs = [{"role": "user", "content": "Write a haiku"},
            {"role": "assistant", "content": "Autumn", "prefix": True}]
    assert render_chat(msgs) == B + U + "Write a haiku" + A + "</think>Autumn"


@pytest.mark.parametrize("msgs, param", [
    ([], "messages"),
    ([{"role": "system", "content": "only"}], "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "messages[1].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"id": "1"}]},
      {"role": "tool", "content": "r"}], "messages[1].tool_calls"),
])
def test_unrenderable_messages_name_the_field(msgs, param):
    with pytest.raises(ChatTemplateError) as err:
        render_chat(msgs)
    assert err.value.param == param


@pytest.mark.parametrize("kwargs, effort, thinking, expected", [
    (None, None, None, False),
    ({"thinking": True}, None, None, True),
    ({"enable_thinking": True}, None, None, True),
    ({"thinking": False}, "high", None, False),  # explicit kwargs win
    (None, "high", None, True),
    (None, "none", None, False),
    (None, None, {"type": "enabled"}, True),
    (None, "high", {"type": "disabled"}, False),
])
def test_thinking_switch(kwargs, effort, thinking, expected):
    assert thinking_requested(kwargs, effort, thinking) is expected


def test_encode_chat_maps_special_strings_to_single_ids():
    import ds4ref
    from ds4ref.serve.chat import encode_chat

    tok = ds4ref.load().tokenizer
    ids = encode_chat(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    sid = tok.token_to_id
    assert ids[0] == tok.bos_id == 0
    assert ids[-2:] == [sid("<｜Assistant｜>"), sid("</think>")]
    user_at = ids.index(sid("<｜User｜>"))
    assert tok.decode(ids[1:user_at]) == "S" and tok.decode(ids[user_at + 1:-2]) == "hi"

"""DeepSeek-V4's chat format: the rendered prompt's token ids against hand-written expectations.

The expectations spell the format out by hand: the special ids the release assigns (BOS 0, EOS 1,
<｜User｜> 2, <｜Assistant｜> 3, <think> 4, </think> 5) and the encoding of each literal text piece,
joined in the order the format prescribes (BOS, system text, <｜User｜> text, ..., earlier assistant
turns as <｜Assistant｜></think> content EOS, then <｜Assistant｜> and <think> or </think>).
"""
import pytest

from ds4f.errors import Ds4fError
from ds4f.engine.model.geometry import GEOMETRIES
from ds4f.engine.text import Tokenizer, chat_prompt_ids, render_chat
from ds4f.engine.text.synthetic import write_tokenizer_files

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = 0, 1, 2, 3, 4, 5


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d, GEOMETRIES["tiny"])
    return Tokenizer.load(d)


def test_single_turn(tok):
    msgs = [{"role": "user", "content": "Hello there"}]
    assert render_chat(msgs) == "<｜begin▁of▁sentence｜><｜User｜>Hello there<｜Assistant｜></think>"
    assert chat_prompt_ids(tok, msgs) == [BOS, USER] + tok.encode("Hello there") + [ASSISTANT, END_THINK]


def test_thinking_mode(tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert render_chat(msgs, thinking=True) == "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>"
    assert chat_prompt_ids(tok, msgs, thinking=True) == \
        [BOS, USER] + tok.encode("What is 2+2?") + [ASSISTANT, THINK]


def test_system_prompt(tok):
    msgs = [{"role": "system", "content": "You are a lighthouse keeper."},
            {"role": "user", "content": "Any boats?"}]
    assert render_chat(msgs) == ("<｜begin▁of▁sentence｜>You are a lighthouse keeper.<｜User｜>Any boats?"
                                 "<｜Assistant｜></think>")
    assert chat_prompt_ids(tok, msgs) == \
        [BOS] + tok.encode("You are a lighthouse keeper.") + [USER] + tok.encode("Any boats?") + [ASSISTANT, END_THINK]


def test_multi_turn_drops_earlier_reasoning(tok):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hello! I keep the light.", "reasoning": "They greet me."},
            {"role": "user", "content": "1+1=?"},
            {"role": "assistant", "content": "2", "reasoning": "Easy."},
            {"role": "user", "content": "Merci, à bientôt 🌊"}]
    want_text = ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>hello<｜Assistant｜></think>Hello! I keep the light."
                 "<｜end▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜></think>2<｜end▁of▁sentence｜>"
                 "<｜User｜>Merci, à bientôt 🌊<｜Assistant｜>")
    assert render_chat(msgs) == want_text + "</think>"
    assert render_chat(msgs, thinking=True) == want_text + "<think>"
    head = ([BOS] + tok.encode("Be brief.") + [USER] + tok.encode("hello") + [ASSISTANT, END_THINK]
            + tok.encode("Hello! I keep the light.") + [EOS, USER] + tok.encode("1+1=?") + [ASSISTANT, END_THINK]
            + tok.encode("2") + [EOS, USER] + tok.encode("Merci, à bientôt 🌊") + [ASSISTANT])
    assert chat_prompt_ids(tok, msgs) == head + [END_THINK]
    assert chat_prompt_ids(tok, msgs, thinking=True) == head + [THINK]
    assert "They greet me" not in render_chat(msgs, thinking=True)


@pytest.mark.parametrize("msgs, what", [
    ([], "last message must be the user's"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last message must be the user's"),
    ([{"role": "robot", "content": "a"}], "role 'robot'"),
    ([{"role": "user", "content": 3}], "content must be a string"),
    ([{"role": "user", "content": "a", "reasoning": 1}], "reasoning must be a string"),
    ("hello", "a list of"),
    (["hello"], "mapping expected"),
])
def test_bad_messages(msgs, what):
    with pytest.raises(Ds4fError, match=what) as e:
        render_chat(msgs)
    assert e.value.param == "messages"

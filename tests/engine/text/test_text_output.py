"""Thinking mode's output split into the reasoning and the answer, as it streams (ReasoningSplit,
used by the server's deltas and the CLI's printing) and whole (split_reasoning)."""
from ds4f.engine.text.output import ReasoningSplit, split_reasoning


def test_the_reasoning_is_split_from_the_answer_however_the_text_is_cut():
    text = "First I think. Then</think>The answer."
    for cuts in ([len(text)], [3, 17, 19, 21, len(text)], list(range(1, len(text) + 1))):
        split, fields, start = ReasoningSplit(True), [], 0
        for cut in cuts:                                  # the text in pieces, the marker split across them
            fields += split.push(text[start:cut])
            start = cut
        fields += split.finish()
        joined = {k: "".join(v for key, v in fields if key == k) for k in ("reasoning", "answer")}
        assert joined == {"reasoning": "First I think. Then", "answer": "The answer."}, cuts
        assert (joined["reasoning"], joined["answer"]) == split_reasoning(text, thinking=True)


def test_held_text_is_released_and_chat_mode_is_all_answer():
    unfinished = ReasoningSplit(True)
    assert unfinished.push("still </thi") + unfinished.finish() == [("reasoning", "still "), ("reasoning", "</thi")]
    assert ReasoningSplit(False).push("a</think>b") == [("answer", "a</think>b")]
    assert split_reasoning("a</think>b", thinking=False) == ("", "a</think>b")
    named = ReasoningSplit(True, reasoning="reasoning_content", answer="content")
    assert named.push("r</think>a") == [("reasoning_content", "r"), ("content", "a")]

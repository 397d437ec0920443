"""A streamed answer's text: a stop string cuts it where it begins, its first characters are held back until they
cannot begin one, and with min_tokens a stop string ends the answer only past the first min_tokens tokens' text
(vLLM's rule), one that straddles that edge included."""
from data.tokenizers import CharTokenizer
from serving.text import TextStream

TOKENIZER = CharTokenizer.from_text("abcdefgXY")


def streamed(text: str, stops: list[str], min_tokens: int = 0, leading: tuple = (),
             tokenizer=TOKENIZER) -> tuple[str, bool]:
    """The text a stream sends of `text` token by token, and whether a stop string (or a leading mark) ended it."""
    stream, sent = TextStream(tokenizer, stops, min_tokens, leading), ""
    for token in tokenizer.encode(text):
        piece, stopped = stream.add(token)
        sent += piece
        if stopped:
            return sent, True
    return sent + stream.rest(), False


def test_a_stop_string_cuts_the_text_and_its_start_is_held_back():
    assert streamed("abcXYdefXYg", ["XY"]) == ("abc", True)
    stream = TextStream(TOKENIZER, ["XY"])
    assert [stream.add(t)[0] for t in TOKENIZER.encode("abX")] == ["a", "b", ""]  # X may begin the stop string
    assert stream.add(TOKENIZER.encode("c")[0]) == ("Xc", False)


def test_min_tokens_lets_a_stop_string_end_the_answer_only_past_its_first_tokens():
    assert streamed("abcXYdefXYg", ["XY"], min_tokens=5) == ("abcXYdef", True)  # "abcXY": its XY does not count
    assert streamed("abcXYdefXYg", ["XY"], min_tokens=4) == ("abc", True)  # "abcX": XY ends past it
    assert streamed("abcXYdefg", ["XY"], min_tokens=6) == ("abcXYdefg", False)

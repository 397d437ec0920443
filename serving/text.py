"""A generated sequence as text, piece by piece as its tokens arrive: what is safe to send now (never the start of
a possible stop string, never half a UTF-8 character a byte-level tokenizer has only begun), and where a stop
string ends it (never within the text of the answer's first `min_tokens` tokens, vLLM's rule). A `leading` string
ends it only where the text begins with one (after whitespace), so the text is held until it is known not to."""


class TextStream:
    def __init__(self, tokenizer, stops: list[str], min_tokens: int = 0, leading: tuple[str, ...] = (),
                 tokens: list[int] = (), skip: int = 0):
        """`tokens`, `skip`: the answer's tokens so far, and the characters of their text before this stream's (a
        thinking model's reasoning and its </think>, serving/answer.py)."""
        self.tokenizer, self.stops, self.min_tokens = tokenizer, [s for s in stops if s], min_tokens
        self.leading, self.skip = leading, skip
        self.tokens: list[int] = list(tokens)
        self.text, self.sent = "", 0
        self.whole = ""  # all of the tokens' text from `skip` on, a stop string and what follows it too
        self.floor = 0  # the length of the first min_tokens tokens' text: a stop string must end past it
        self.stop: str | None = None  # the stop string that ended the text

    def add(self, token: int) -> tuple[str, bool]:
        """(the text to send now, whether a stop string ended the sequence: the text stops before it)."""
        self.tokens.append(token)
        self.text = self.whole = self.tokenizer.decode(self.tokens)[self.skip:]
        if len(self.tokens) <= self.min_tokens:
            self.floor = len(self.text)
        if self.leading:
            begun = self.text.lstrip()
            self.stop = next((mark for mark in self.leading if begun.startswith(mark)), None)
            if self.stop is not None:  # nothing was sent: the whitespace before it is no text either
                self.text = ""
                return "", True
            if any(mark.startswith(begun) for mark in self.leading):
                return "", False
        found = [(i, stop) for i, stop in ((self.text.find(stop, max(0, self.floor - len(stop) + 1)), stop)
                                           for stop in self.stops) if i >= 0]
        if found:
            at, self.stop = min(found)
            self.text = self.text[:at]
            return self._send(len(self.text)), True
        safe = len(self.text.rstrip("\ufffd"))  # a multi-byte character still incomplete
        held = max([n for stop in self.stops for n in range(1, min(len(stop) - 1, safe) + 1)
                    if self.text[:safe].endswith(stop[:n])], default=0)  # a tail a stop string may begin with
        return self._send(max(safe - held, self.sent)), False

    def rest(self) -> str:
        """What was held back, sent when the sequence ends otherwise."""
        return self._send(len(self.text))

    def _send(self, upto: int) -> str:
        piece, self.sent = self.text[self.sent:upto], upto
        return piece

"""One choice's answer as its tokens arrive, cut into what its deltas send: a thinking model's reasoning (its text
before </think>, as vLLM's reasoning parsers for Qwen 3 and DeepSeek-R1 read it), then the content (serving/text.py:
stop strings, characters not yet whole) and, where tools may be called, the calls' pieces (serving/tools.py), which
are read from the content alone."""
from dataclasses import dataclass, field

from serving.reasoning import THINK, THOUGHT, thought_marks
from serving.text import TextStream
from serving.tools import CallStream


@dataclass
class Sent:
    """What a delta sends of the answer."""
    reasoning: str = ""
    content: str = ""
    pieces: list = field(default_factory=list)  # of the calls (CallStream's)
    calls: list = field(default_factory=list)  # the calls, whole, at the answer's end
    reason: str | None = None  # why the answer ended, at its end


class Answer:
    def __init__(self, tokenizer, asked, min_tokens: int, think: str | None):
        """`asked`: the request's (serving/requests.py); `think`: thinking()'s. Under a grammar (a response format, a
        forced call) the grammar begins after the thought where the tokenizer writes <think> and </think> as a token
        each (thought_marks); otherwise the answer is the grammar's from its first token: it goes on in no thought
        the prompt opened, and thinks only where the grammar writes <think> first."""
        if asked.grammar is not None and think == "open" and thought_marks(tokenizer) is None:
            think = "may"
        self.tokenizer, self.stops, self.min_tokens = tokenizer, asked.stops, min_tokens
        self.tools = asked.tools if asked.tools is not None and asked.tools.choice != "none" else None
        self.reading = self.tools.reading() if self.tools is not None else None
        self.marks = self.reading.marks if self.reading else ()  # where auto's calls begin: the content ends
        self.calls = CallStream(self.tools) if self.tools is not None else None
        self.forced = self.tools is not None and self.reading is None  # the whole content is calls
        self.calling, self.shown = self.forced, 0  # whether the calls have begun; content characters sent
        self.ids: list[int] = []  # the answer's ids, stop ids apart
        self.reasoning_tokens = 0  # the tokens of its reasoning, its <think> and </think> included
        self.reasoning = TextStream(tokenizer, [THOUGHT]) if think == "open" else None
        self.content = self._content(0) if think is None else None

    def _content(self, skip: int) -> TextStream:
        """The content's text stream, from character `skip` of the answer's text on; where auto reads calls, its
        format's marks end the content as stop strings do (leading ones only where the content begins with one)."""
        leading = self.marks if self.reading and self.reading.leading else ()
        return TextStream(self.tokenizer, self.stops + [m for m in self.marks if m not in leading], self.min_tokens,
                          leading, self.ids[:-1], skip)

    def add(self, token: int) -> tuple[Sent, bool]:
        """What to send now that `token` (no stop id) ends the answer so far, and whether a stop string ended the
        answer (the Sent is then its last)."""
        self.ids.append(token)
        if self.content is None and self.reasoning is None:  # it may think: its first characters say
            text = self.tokenizer.decode(self.ids)
            begun = text.lstrip()
            if THINK.startswith(begun):
                return Sent(), False
            if begun.startswith(THINK):
                self.reasoning = TextStream(self.tokenizer, [THOUGHT], tokens=self.ids[:-1],
                                            skip=len(text) - len(begun) + len(THINK))
            else:
                self.content = self._content(0)
        sent = Sent()
        if self.content is None:
            sent.reasoning, thought = self.reasoning.add(token)
            self.reasoning_tokens = len(self.ids)
            if not thought:
                return sent, False
            self.content = self._content(self.reasoning.skip + len(self.reasoning.text) + len(THOUGHT))
        piece, stopped = self.content.add(token)
        if stopped and self.content.stop not in self.marks:
            last = self.last("stop", piece, cut=True)
            return Sent(sent.reasoning + last.reasoning, last.content, last.pieces, last.calls, last.reason), True
        self.calling = self.calling or stopped  # auto's calls have begun
        sent.content = "" if self.forced else piece
        self.shown += len(sent.content)
        sent.pieces = self.calls.pieces(self.content.whole) if self.calling else []
        return sent, False

    def last(self, reason: str, piece: str = "", cut: bool = False) -> Sent:
        """What is left to send as the answer ends: the reasoning held back (all of the answer where it never
        thought its way out), the content held back (`piece`: the text a stop string's token gave, where one `cut`
        the answer) and, where tools may be called, the calls read from the content with what is still to send of
        them."""
        if self.content is None and self.reasoning is not None:
            return Sent(self.reasoning.rest(), reason=reason)
        if self.content is None:  # too short to say whether it thinks: text
            return Sent(content=self.tokenizer.decode(self.ids), reason=reason)
        if self.calls is None:
            return Sent(content=piece + self.content.rest(), reason=reason)
        whole = self.content.text if cut else self.content.whole
        found, pieces = self.calls.whole(whole)
        rest = "" if found else whole[self.shown:]  # what was sent is the content; calls that do not read are content
        return Sent(content=rest, pieces=pieces, calls=found, reason=self.tools.finish_reason(reason, found))

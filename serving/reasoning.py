"""How a thinking model's answer thinks (Qwen 3's, DeepSeek-R1's): the marks of its thought, whether an answer
thinks, and the marks' ids where the tokenizer writes each as one token. serving/answer.py cuts the answer's text by
them, serving/structured.py begins a grammar after the thought."""

THINK, THOUGHT = "<think>", "</think>"


def thinking(template: str, prompt: str) -> str | None:
    """How an answer to `prompt` (its text) thinks: None where the chat template writes no reasoning; "open" where
    the prompt opened a <think> the answer goes on in (DeepSeek-R1's generation prompt); else "may" (Qwen 3's answer
    begins with <think>, or not where the prompt closed one: enable_thinking false)."""
    if THOUGHT not in template:
        return None
    return "open" if prompt.rfind(THINK) > prompt.rfind(THOUGHT) else "may"


def thought_marks(tokenizer) -> tuple[int, int] | None:
    """The ids of <think> and </think> where each is one token of the tokenizer (Qwen 3's, DeepSeek-R1's): a grammar
    then begins after the thought, as vLLM's does under a reasoning parser (serving/structured.py's Thinking). None
    where either is several tokens or none: the grammar writes the whole answer."""
    try:
        ids = [tokenizer.encode(mark) for mark in (THINK, THOUGHT)]
    except ValueError:  # characters a character vocabulary lacks
        return None
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None

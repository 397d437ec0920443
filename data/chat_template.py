"""Chat templates: Jinja, rendered as transformers renders them (a sandbox; trim_blocks, lstrip_blocks; tojson,
raise_exception, strftime_now; the tokenizer's special tokens), with the character spans of each `{% generation %}`
block (the assistant's parts the loss trains on) and the `tools` transformers passes. A template that is not Jinja,
or that raises as it renders, raises ChatTemplateError with the template's line."""
import json
from contextvars import ContextVar
from datetime import datetime

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' mark of where a continued last turn's content ends


class ChatTemplateError(ValueError):
    """A chat template that is not Jinja (syntax), or that raised while it rendered a conversation (render): Jinja's
    message and the template's line (None where none is known), and whether the template's raise_exception refused
    the conversation. Callers name the template and the conversation."""

    def __init__(self, problem: str, line: int | None, syntax: bool, refused: bool = False, unmarked: bool = False):
        self.problem, self.line, self.syntax = problem, line, syntax
        self.refused = refused  # by the template's own raise_exception(...): the conversation may be what is wrong
        self.unmarked = unmarked  # its answers not found without {% generation %} marks (ChatTemplate.answer_spans)
        super().__init__(self.describe("the chat template", "a conversation"))

    def describe(self, template: str, conversation: str) -> str:
        """'TEMPLATE is not valid Jinja at line N (PROBLEM)', or 'TEMPLATE fails at line N on CONVERSATION
        (PROBLEM)'."""
        at = f" at line {self.line}" if self.line is not None else ""
        if self.syntax:
            return f"{template} is not valid Jinja{at} ({self.problem})"
        return f"{template} fails{at} on {conversation} ({self.problem})"


class ChatTemplate:
    """A Jinja chat template, rendered with the spans of its `{% generation %}` blocks. A template that is not
    Jinja, or that raises as it renders, raises ChatTemplateError with the template's line."""

    def __init__(self, source: str, special_tokens: dict | None = None):
        """`special_tokens`: the tokenizer's that transformers gives every template (bos_token, eos_token, ...:
        template_tokens), which Llama's and Mistral's templates write."""
        import jinja2
        import jinja2.meta

        self.source, self.special_tokens = source, special_tokens or {}
        self._spans = ContextVar("generation_spans", default=None)
        try:
            self.template = _environment(self._spans).from_string(source)
        except jinja2.TemplateSyntaxError as e:  # and TemplateAssertionError: an unknown filter or test
            raise ChatTemplateError(_one_line(e.message or type(e).__name__), e.lineno, syntax=True) from None
        self.marks_generation = "generation" in source and "endgeneration" in source
        # the names it reads that the renderer may give: messages, tools, add_generation_prompt, a model's own
        self.variables = jinja2.meta.find_undeclared_variables(self.template.environment.parse(source))
        self.renders_tools = "tools" in self.variables

    def render(self, turns: list[dict], add_generation_prompt: bool = False, tools: list | None = None,
               variables: dict | None = None, continue_final: bool = False,
               answers: str = "all") -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text, and the (start, end) character spans of its assistant parts (its {% generation %}
        blocks, else answer_spans': `answers` "all", "last" or "none", those asked for); `tools` as transformers
        passes them (OpenAI's tool definitions); `variables`: more of the template's own (Qwen 3's enable_thinking,
        say). `continue_final`: the text ends where the last turn's content does, which an answer then continues
        (transformers' continue_final_message)."""
        text, spans = self._render(turns, add_generation_prompt, tools, variables, continue_final)
        if self.marks_generation or add_generation_prompt or continue_final or answers == "none":
            return text, spans
        return text, self.answer_spans(turns, tools, variables, text, answers == "last")

    def answer_spans(self, turns: list[dict], tools, variables, text: str, last: bool) -> list[tuple[int, int]]:
        """For a template without {% generation %} marks (a Hub model's own): each assistant turn's span the text it
        adds after the prompt that asks for it (rendered with add_generation_prompt), less its trailing whitespace
        (ChatML's newline after <|im_end|>): its answer and end of turn, as the marks of the same template put
        around them. Found where the template renders each turn alike whatever follows it; Qwen 3's drops earlier
        answers' thinking, which only the last answer's span survives (`last`)."""
        spans = []
        answers = [k for k, turn in enumerate(turns) if turn.get("role") == "assistant"]
        for k in answers[-1:] if last else answers:
            asked = self._render(turns[:k], True, tools, variables)[0]
            answered = self._render(turns[:k + 1], False, tools, variables)[0]
            if not (answered.startswith(asked) and text.startswith(answered)):
                raise ChatTemplateError(f"it renders turn {k + 1}, an answer, otherwise once its prompt or later turns "
                                        f"follow, so its answers are not found without {{% generation %}} marks",
                                        None, False, unmarked=True)
            if len(answered.rstrip()) > len(asked):
                spans.append((len(asked), len(answered.rstrip())))
        return spans

    def _render(self, turns: list[dict], add_generation_prompt: bool, tools: list | None, variables: dict | None,
                continue_final: bool = False) -> tuple[str, list[tuple[int, int]]]:
        if continue_final:
            turns = [*turns[:-1], {**turns[-1], "content": turns[-1]["content"] + CONTINUE_TAG}]
        blocks, spans = [], []
        token = self._spans.set((blocks, spans))
        try:
            for block in self.template.generate(messages=turns, tools=tools,
                                                add_generation_prompt=add_generation_prompt,
                                                **{**self.special_tokens, **(variables or {})}):
                blocks.append(block)
        except Exception as e:  # anything the template's code raised: an undefined name called, a filter, ...
            raised = getattr(e, "raised_by_template", False)
            problem = f"raise_exception: {e}" if raised else f"{type(e).__name__}: {e}"
            raise ChatTemplateError(_one_line(problem), self._line(e.__traceback__), False, raised) from None
        finally:
            self._spans.reset(token)
        text = "".join(blocks)
        if continue_final:
            if CONTINUE_TAG.strip() not in text:
                raise ChatTemplateError("the last turn's content is not in the text it renders", None, False)
            # where the template trims the content, the tag's space with it: the text ends at the content's last
            # non-space character then, as transformers cuts it
            at = text.rindex(CONTINUE_TAG.strip())
            text = text[:at] if text[at:].startswith(CONTINUE_TAG) else text[:at].rstrip()
        return text, spans

    def _line(self, tb) -> int | None:
        """The template line of the innermost frame of template code in a traceback: Jinja rewrites the frames of
        a compiled template into frames of its file name (the template's, "<template>" for one from a string) and
        its line."""
        line = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == (self.template.filename or "<template>"):
                line = tb.tb_lineno
            tb = tb.tb_next
        return line


# The special tokens of a tokenizer_config.json that transformers passes to a chat template (its special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def template_tokens(config: dict) -> dict:
    """The special tokens a tokenizer_config.json (`config`, its record) gives chat templates, as strings (the file
    writes each as a string or as an added token's {"content": ...}); its additional special tokens as a list."""
    def text(value):
        return value.get("content") if isinstance(value, dict) else value

    found = {key: text(config[key]) for key in SPECIAL_TOKENS if isinstance(text(config.get(key)), str)}
    extra = [text(t) for t in config.get("additional_special_tokens") or [] if isinstance(text(t), str)]
    return {**found, **({"additional_special_tokens": extra} if extra else {})}


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _environment(spans: ContextVar):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %} ... {% endgeneration %}: records where its output lands in the rendered text."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            tracked = spans.get()
            if tracked is not None:
                blocks, found = tracked
                start = sum(len(b) for b in blocks)
                found.append((start, start + len(text)))
            return text

    def raise_exception(message):  # as transformers defines it, marked as the template's own refusal
        error = jinja2.exceptions.TemplateError(message)
        error.raised_by_template = True
        raise error

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    # Llama 3's templates write today's date into the system turn where this is defined, as transformers defines it
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env

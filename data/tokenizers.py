"""The two tokenizers: characters of the text itself, and GPT-2 BPE through tiktoken."""
import tiktoken

TOKENIZERS = ("char", "gpt2")


class CharTokenizer:
    name = "char"

    def __init__(self, chars: list[str]):
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in this dataset's vocabulary") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def meta(self) -> dict:
        return {"chars": self.chars}


class Gpt2Tokenizer:
    name = "gpt2"

    def __init__(self, encoding: tiktoken.Encoding | None = None):
        if encoding is None:
            try:
                encoding = tiktoken.get_encoding("gpt2")
            except Exception as e:
                raise RuntimeError(
                    f"could not load the GPT-2 BPE files ({type(e).__name__}: {e}). tiktoken downloads them "
                    "once; on an offline machine copy a populated tiktoken cache from a machine with "
                    "network access and point TIKTOKEN_CACHE_DIR at it.") from None
        self.encoding = encoding

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    def meta(self) -> dict:
        return {"encoding": self.encoding.name}


def tokenizer_from_meta(meta: dict):
    """The tokenizer a prepared dataset was written with."""
    if meta["tokenizer"] == "char":
        return CharTokenizer(meta["chars"])
    return Gpt2Tokenizer()

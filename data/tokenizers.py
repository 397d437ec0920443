"""Tokenizers a dataset can be prepared with, and the one a prepared dataset was written with.

    char                      the characters of the corpus (+ an end-of-text id when it has several documents)
    gpt2, tiktoken:NAME       tiktoken encodings (cl100k_base, o200k_base, ...)
    PATH/tokenizer.json       any Hugging Face tokenizer (Llama-3's, ...)
    FOLDER                    the tokenizer of a prepared dataset, of an export (python -m scripts.export) or
                              of a Hugging Face model folder (its tokenizer.json): a model's own, to fine-tune it
    bpe:SIZE                  a byte-level BPE of SIZE ids trained on the corpus itself (data/prepare.py)

Each one is saved beside the data it tokenized (chars in meta.json, tokenizer.tiktoken, tokenizer.json) with a
fingerprint in meta.json, so training, sampling and export read that copy and need no network.
`load_tokenizer(data_dir)` returns it: encode, decode, vocab_size, eot_id, save(dir).
"""
import base64
import hashlib
import json
import os

EOT = "<|endoftext|>"
# Names of the end-of-text (appended to each document) and, failing that, begin-of-text (prepended)
# tokens in the tokenizer.json files people use (GPT-2, Llama-3, Mistral, T5/Gemma).
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
TIKTOKEN_FILE, HF_FILE = "tokenizer.tiktoken", "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer that cannot be built or read; the message names the file and the fix."""


class CharTokenizer:
    """Characters of the corpus. A single-document corpus (the quickstart) has no end-of-text id."""
    name = "char"

    def __init__(self, chars: list[str], eot: bool = False):
        self.chars, self.eot_id = list(chars), (len(chars) if eot else None)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.delimiter = "eot" if eot else None

    @classmethod
    def from_text(cls, text: str, eot: bool = False) -> "CharTokenizer":
        return cls(sorted(set(text)), eot)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + (self.eot_id is not None)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in this dataset's vocabulary") from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each one's (start, end) in `text`, which may hold the end-of-text token written out (a chat
        template's)."""
        ids, offsets, start = [], [], 0
        for i, part in enumerate(text.split(EOT) if self.eot_id is not None else [text]):
            if i:
                ids.append(self.eot_id)
                offsets.append((start, start + len(EOT)))
                start += len(EOT)
            ids += self.encode(part)
            offsets += [(start + j, start + j + 1) for j in range(len(part))]
            start += len(part)
        return ids, offsets

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else EOT for i in ids)

    def meta(self) -> dict:
        return {"chars": self.chars, "eot_id": self.eot_id}

    def save(self, directory: str) -> list[str]:
        return []  # the characters live in meta.json

    def fingerprint(self) -> str:
        return _sha({"chars": self.chars, "eot": self.eot_id})


class TiktokenTokenizer:
    """A tiktoken encoding; one without an end-of-text token gets one after its last id."""

    def __init__(self, encoding):
        import tiktoken

        if EOT not in encoding._special_tokens:
            encoding = tiktoken.Encoding(encoding.name, pat_str=encoding._pat_str,
                                         mergeable_ranks=encoding._mergeable_ranks,
                                         special_tokens={**encoding._special_tokens, EOT: encoding.n_vocab})
        self.encoding, self.eot_id, self.delimiter = encoding, encoding._special_tokens[EOT], "eot"
        self.name = "gpt2" if encoding.name == "gpt2" else f"tiktoken:{encoding.name}"

    @classmethod
    def by_name(cls, name: str) -> "TiktokenTokenizer":
        import tiktoken

        try:
            return cls(tiktoken.get_encoding(name))
        except Exception as e:
            raise TokenizerError(
                f"could not load the tiktoken encoding {name!r} ({type(e).__name__}: {e}). tiktoken downloads its "
                "files once; on an offline machine copy a populated tiktoken cache from a machine with network "
                "access and point TIKTOKEN_CACHE_DIR at it") from None

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encode = self.encoding.encode_ordinary  # one thread: --workers sets the parallelism
        return [encode(t) for t in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids (special tokens written out in `text` become theirs) and each one's (start, end) in `text`."""
        ids = self.encoding.encode(text, allowed_special="all")
        _, starts = self.encoding.decode_with_offsets(ids)
        return ids, list(zip(starts, [*starts[1:], len(text)]))

    def decode(self, ids) -> str:
        return self.encoding.decode(list(ids))

    def meta(self) -> dict:
        return {"encoding": self.encoding.name, "pat_str": self.encoding._pat_str,
                "special_tokens": self.encoding._special_tokens, "eot_id": self.eot_id,
                "tokenizer_file": TIKTOKEN_FILE}

    def save(self, directory: str) -> list[str]:
        """tiktoken's own .tiktoken format (base64 token, rank per line), written here: tiktoken's
        dump_tiktoken_bpe needs the blobfile package."""
        ranks = sorted(self.encoding._mergeable_ranks.items(), key=lambda kv: kv[1])
        with open(os.path.join(directory, TIKTOKEN_FILE), "w") as f:
            f.writelines(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks)
        return [TIKTOKEN_FILE]

    def fingerprint(self) -> str:
        ranks = sorted(self.encoding._mergeable_ranks.items(), key=lambda kv: kv[1])
        return _sha({"pat": self.encoding._pat_str, "special": self.encoding._special_tokens,
                     "ranks": [base64.b64encode(k).decode() for k, _ in ranks]})

    @classmethod
    def from_files(cls, meta: dict, directory: str) -> "TiktokenTokenizer":
        import tiktoken

        with open(os.path.join(directory, meta["tokenizer_file"])) as f:
            ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in f if line.strip())}
        return cls(tiktoken.Encoding(meta["encoding"], pat_str=meta["pat_str"], mergeable_ranks=ranks,
                                     special_tokens=meta["special_tokens"]))


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (given by path, or a BPE trained on the corpus)."""

    def __init__(self, tokenizer, name: str, source: str = ""):
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.tokenizer, self.name = tokenizer, name
        eot = next((t for t in EOT_NAMES if t in vocab), None)
        bos = next((t for t in BOS_NAMES if t in vocab), None)
        if eot is None and bos is None:
            raise TokenizerError(f"{source or name} has no end-of-text or begin-of-text token (one of "
                                 f"{', '.join(EOT_NAMES + BOS_NAMES)}) to delimit documents with: add one as a "
                                 f"special token to the tokenizer")
        # Documents end with EOT; a tokenizer with only a BOS (Llama-2 style) starts them with it.
        self.delimiter = "eot" if eot else "bos"
        self.eot_id = vocab[eot] if eot else None
        self.bos_id = vocab[bos] if bos else None

    @classmethod
    def from_file(cls, path: str, name: str | None = None) -> "HFTokenizer":
        Tokenizer = _tokenizers().Tokenizer
        try:
            tokenizer = Tokenizer.from_file(path)
        except Exception as e:
            raise TokenizerError(f"could not read the tokenizer file {path} ({type(e).__name__}: {e}): pass a "
                                 f"Hugging Face tokenizer.json, e.g. --tokenizer path/to/Meta-Llama-3-8B/"
                                 f"tokenizer.json") from None
        return cls(tokenizer, name or "tokenizer.json", path)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids (special tokens written out in `text` become theirs) and each one's (start, end) in `text`."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def meta(self) -> dict:
        return {"eot_id": self.eot_id, "bos_id": self.bos_id, "tokenizer_file": HF_FILE}

    def save(self, directory: str) -> list[str]:
        self.tokenizer.save(os.path.join(directory, HF_FILE))
        return [HF_FILE]

    def fingerprint(self) -> str:
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()


def train_bpe(documents, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2's scheme) of `vocab_size` ids trained on `documents` with `tokenizers`."""
    tokenizers = _tokenizers()
    decoders, models, pre_tokenizers, trainers = (tokenizers.decoders, tokenizers.models, tokenizers.pre_tokenizers,
                                                   tokenizers.trainers)
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    return HFTokenizer(tokenizer, f"bpe:{vocab_size}")


def parse_spec(spec: str):
    """--tokenizer -> ("ready", tokenizer), or ("char", None) / ("bpe", size) for those built from the corpus.
    A tokenizer object is taken as it is (tests build tiktoken encodings that need no download)."""
    if not isinstance(spec, str):
        return "ready", spec
    if spec == "char":
        return "char", None
    if spec.startswith("bpe:"):
        size = spec[4:]
        if not size.isdigit() or int(size) < 257:
            raise TokenizerError(f"--tokenizer {spec}: the BPE size must be an integer above 256 (the byte "
                                 f"alphabet), e.g. bpe:32000")
        return "bpe", int(size)
    if spec == "gpt2" or spec.startswith("tiktoken:"):
        return "ready", TiktokenTokenizer.by_name(spec.split(":", 1)[-1])
    if os.path.isdir(spec):
        return "ready", folder_tokenizer(spec)
    if spec.endswith(".json") or os.path.sep in spec:
        if not os.path.isfile(spec) and spec.endswith(".json"):
            raise TokenizerError(f"tokenizer file {spec} not found: pass the path of a Hugging Face tokenizer.json")
        if not os.path.isfile(spec):
            raise TokenizerError(f"--tokenizer {spec} not found: pass a Hugging Face tokenizer.json, or a folder that "
                                 f"holds a tokenizer (an export of python -m scripts.export, a prepared dataset)")
        return "ready", HFTokenizer.from_file(spec)
    raise TokenizerError(f"unknown --tokenizer {spec!r}: use char, gpt2, tiktoken:NAME (cl100k_base, o200k_base), "
                         f"a path to a tokenizer.json, a folder holding a tokenizer (a dataset's, an export's), or "
                         f"bpe:SIZE")


def folder_tokenizer(folder: str):
    """The tokenizer a folder holds: a prepared dataset's (meta.json), an export's (config.json's
    megalite.tokenizer, written by python -m scripts.export; a character vocabulary lives there) or a Hugging Face
    model's tokenizer.json. A model fine-tuned from an export takes its ids from the same tokenizer this way."""
    fix = ("pass a prepared dataset's folder (meta.json), an export's (python -m scripts.export) or a folder with a "
           "Hugging Face tokenizer.json")
    for name, section in (("meta.json", None), ("config.json", "megalite")):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                record = json.loads(f.read())
        except (OSError, ValueError) as e:
            raise TokenizerError(f"--tokenizer {folder}: {path} does not read as JSON ({type(e).__name__}); fix: "
                                 f"{fix}") from None
        meta = record
        if section is not None:  # an export's config.json: {"megalite": {"tokenizer": {...}}}
            meta = record.get(section) if isinstance(record, dict) else None
            meta = meta.get("tokenizer") if isinstance(meta, dict) else None
        if isinstance(meta, dict) and "tokenizer" in meta:
            try:
                return tokenizer_from_meta(meta, folder)
            except (KeyError, TypeError) as e:
                raise TokenizerError(f"--tokenizer {folder}: the tokenizer record of {path} lacks {e}; fix: prepare "
                                     f"or export it again") from None
    if os.path.isfile(os.path.join(folder, HF_FILE)):
        return HFTokenizer.from_file(os.path.join(folder, HF_FILE))
    raise TokenizerError(f"--tokenizer {folder} is a folder that holds no tokenizer; fix: {fix}")


def tokenizer_from_meta(meta: dict, directory: str | None = None,
                        fix: str = "the dataset's tokenizer must stay beside its meta.json; prepare the dataset again"):
    """The tokenizer a prepared dataset (or an export: `fix` says how to mend each) was written with, its files
    read from `directory`."""
    name = meta["tokenizer"]
    if name == "char":
        return CharTokenizer(meta["chars"], eot=meta.get("eot_id") is not None)
    if "tokenizer_file" not in meta:
        raise TokenizerError(f"the dataset's meta.json names no tokenizer_file for its {name} tokenizer: it is "
                             f"damaged; prepare the dataset again")
    path = os.path.join(directory or ".", meta["tokenizer_file"])
    if not os.path.isfile(path):
        raise TokenizerError(f"{path} is missing: {fix}")
    if meta["tokenizer_file"] == TIKTOKEN_FILE:
        return TiktokenTokenizer.from_files(meta, directory)
    return HFTokenizer.from_file(path, name)


def delimiter_id(tokenizer) -> int | None:
    """The id that separates documents (end-of-text, or begin-of-text for a tokenizer with only that); None for
    a one-document char dataset."""
    return getattr(tokenizer, "bos_id", None) if tokenizer.delimiter == "bos" else tokenizer.eot_id


def sampling_start(text: str, tokenizer) -> tuple[list[int], str | None]:
    """The ids a sample starts from, and a note when they are not the text's own. A prompt that encodes to no
    tokens (a newline, for a tokenizer that splits on whitespace) starts from the document delimiter: what
    sampling "from nothing" means for a model trained on delimited documents. ValueError when it cannot start."""
    ids = tokenizer.encode(text)  # ValueError for a character outside a char vocabulary
    if ids:
        return ids, None
    start = delimiter_id(tokenizer)
    if start is None:
        raise ValueError("it encodes to no tokens, and the dataset has no document delimiter to start from")
    return [start], (f"the prompt {text!r} encodes to no tokens with the dataset's {tokenizer.name} tokenizer: the "
                     f"sample starts from its document delimiter {tokenizer.decode([start])!r} (id {start})")


def load_tokenizer(data_dir: str):
    """The tokenizer of the prepared dataset in `data_dir`: encode, decode, vocab_size, eot_id, save(dir).
    (For Hugging Face tokenizers, save(dir) writes dir/tokenizer.json.)"""
    with open(os.path.join(data_dir, "meta.json")) as f:
        return tokenizer_from_meta(json.load(f), data_dir)


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("tokenizer.json files and bpe:SIZE need the tokenizers package: pip install "
                             "'megalite[corpora]'") from None
    return tokenizers


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()

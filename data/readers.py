"""Documents from input files, split into pieces that workers read independently.

    .txt                      a file is a document (or, with split_blank_lines, each blank-line-separated block)
    .jsonl                    one JSON record per line, the text in `text_key`; split into byte ranges
    .jsonl.gz, .jsonl.zst     the same, streamed (one piece per file: compressed streams cannot be split)
    .parquet                  one piece per row group, read with pyarrow
    hf:NAME[:CONFIG]          a Hugging Face dataset through `datasets` (streaming), one piece per data file

A piece is a pure description (file, byte range or row group), so the pieces and the documents in each
are the same whatever the number of workers. Every error names the file (and line, for JSONL) and the fix,
a file that is not what its name says (a .jsonl.gz that is not gzip, a cut-off .jsonl.zst) included.
"""
import glob
import gzip
import io
import json
import os
import zlib
from dataclasses import dataclass

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
HF_PREFIX = "hf:"


class InputError(ValueError):
    """Bad input; the message names the file (and line) and how to fix it."""


@dataclass(frozen=True)
class Piece:
    path: str  # a file, or hf:NAME[:CONFIG]
    kind: str  # txt, jsonl, jsonl.gz, jsonl.zst, parquet, hf
    start: int = 0  # byte offset (jsonl), row group (parquet) or shard (hf)
    stop: int = 0  # byte offset where the next piece starts (jsonl); unused otherwise


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files of each --input (a file, a folder searched recursively, or a glob), in a stable order."""
    files = []
    for spec in inputs:
        if spec.startswith(HF_PREFIX):
            files.append(spec)
            continue
        if os.path.isdir(spec):
            found = sorted(p for p in glob.glob(os.path.join(spec, "**", "*"), recursive=True) if os.path.isfile(p))
        elif any(c in spec for c in "*?["):
            found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        elif os.path.isfile(spec):
            found = [spec]
        else:
            raise InputError(f"input {spec} not found: pass a file, a folder or a glob of {', '.join(SUFFIXES)} files")
        found = [p for p in found if kind_of(p)]
        if not found:
            raise InputError(f"input {spec} holds no {', '.join(SUFFIXES)} file: point --input at your documents")
        files.extend(os.path.abspath(p) for p in found)
    return files


def kind_of(path: str) -> str | None:
    if path.startswith(HF_PREFIX):
        return "hf"
    return next((s[1:] for s in sorted(SUFFIXES, key=len, reverse=True) if path.endswith(s)), None)


def plan_pieces(files: list[str], chunk_bytes: int) -> list[Piece]:
    pieces = []
    for path in files:
        kind = kind_of(path)
        if kind == "jsonl":
            size = os.path.getsize(path)
            pieces += [Piece(path, kind, a, min(a + chunk_bytes, size)) for a in range(0, max(size, 1), chunk_bytes)]
        elif kind == "parquet":
            groups = _parquet_file(path).metadata.num_row_groups
            pieces += [Piece(path, kind, g) for g in range(groups)]
        elif kind == "hf":
            pieces += [Piece(path, kind, s) for s in range(_hf_shards(_hf_dataset(path)))]
        else:
            pieces.append(Piece(path, kind))
    return pieces


def documents(piece: Piece, text_key: str = "text", split_blank_lines: bool = False):
    """The piece's documents (str), in file order."""
    try:
        if piece.kind == "txt":
            yield from _txt(piece.path, split_blank_lines)
        elif piece.kind == "parquet":
            yield from _parquet(piece, text_key)
        elif piece.kind == "hf":
            yield from _hf(piece, text_key)
        else:
            yield from _jsonl(piece, text_key)
    except _read_errors(piece.kind) as e:
        raise InputError(_unreadable(piece, e)) from None


# What each kind of file is, for the message when it does not read as one.
FORMATS = {"jsonl.gz": ("gzip", "gzip FILE"), "jsonl.zst": ("zstd", "zstd FILE"),
           "parquet": ("Parquet", "re-export it")}


def _read_errors(kind: str) -> tuple:
    """What reading a damaged file of `kind` raises: gzip's BadGzipFile (an OSError), a cut stream (EOFError) or
    a bad block (zlib.error); zstd's and pyarrow's own errors; an OSError for any file."""
    errors = (OSError, EOFError, zlib.error)
    try:
        if kind == "jsonl.zst":
            import zstandard
            errors += (zstandard.ZstdError,)
        elif kind == "parquet":
            import pyarrow
            errors += (pyarrow.ArrowException,)
    except ImportError:  # the reader said which package is missing
        pass
    return errors


def _unreadable(piece: Piece, e: Exception) -> str:
    why = " ".join(f"{type(e).__name__}: {e}".split())
    if piece.kind not in FORMATS:
        return f"input {piece.path} cannot be read ({why}); fix: check the file, or leave it out of --input"
    name, remake = FORMATS[piece.kind]
    return (f"input {piece.path} is not {name} data, or is cut short ({why}); fix: make it again ({remake}), or "
            f"leave it out of --input")


def _txt(path: str, split_blank_lines: bool):
    with open(path, "rb") as f:
        body = f.read()
    text = _decode(body, path)
    if not split_blank_lines:
        if text:
            yield text
        return
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if block.strip():
            yield block


def _decode(body: bytes, path: str) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path} (byte {e.start}) is not UTF-8 ({e.reason}): convert the file to UTF-8 (e.g. iconv "
                         f"-f latin1 -t utf-8) or leave it out of --input") from None


def _open_lines(piece: Piece):
    if piece.kind == "jsonl.gz":
        return gzip.open(piece.path, "rb")
    if piece.kind == "jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise InputError(f"{piece.path}: reading .zst needs the zstandard package: pip install "
                             f"'megalite[corpora]'") from None
        return io.BufferedReader(_ZstdFrames(piece.path, zstandard.ZstdDecompressor()), 1 << 20)
    return open(piece.path, "rb")


class _ZstdFrames(io.RawIOBase):
    """The frames of a .zst file, one after another. zstandard's own stream reader ends quietly where a file
    is cut short inside a frame; this one raises EOFError, so a truncated file is not read as a shorter one."""

    def __init__(self, path: str, decompressor):
        self.file, self.decompressor, self.frame = open(path, "rb"), decompressor, None
        self.out, self.position = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.position == len(self.out):
            compressed = self.file.read(1 << 18)
            if not compressed:
                if self.frame is not None and not self.frame.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self.out, self.position = self._decompress(compressed), 0
        n = min(len(buffer), len(self.out) - self.position)
        buffer[:n] = self.out[self.position:self.position + n]
        self.position += n
        return n

    def _decompress(self, compressed: bytes) -> bytes:
        out = []
        while compressed:
            if self.frame is None or self.frame.eof:
                self.frame = self.decompressor.decompressobj()
            out.append(self.frame.decompress(compressed))
            compressed = self.frame.unused_data if self.frame.eof else b""
        return b"".join(out)

    def close(self) -> None:
        self.file.close()
        super().close()


def _jsonl(piece: Piece, text_key: str):
    with _open_lines(piece) as f:
        if piece.kind == "jsonl" and piece.start:
            f.seek(piece.start - 1)
            f.readline()  # the line in progress at `start` belongs to the previous piece
        position = first = f.tell() if piece.kind == "jsonl" else 0
        for index, raw in enumerate(f):
            if piece.kind == "jsonl" and position >= piece.stop:
                break
            position += len(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except UnicodeDecodeError as e:
                raise InputError(f"{_where(piece, first, index)} is not UTF-8 ({e.reason}): convert the file to "
                                 f"UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out of --input") from None
            except json.JSONDecodeError as e:
                raise InputError(f"{_where(piece, first, index)}: not a JSON record ({e.msg}): fix or remove the line "
                                 f"(each line of a .jsonl file must be one JSON object)") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise InputError(f"{_where(piece, first, index)}: no text field {text_key!r} (record keys: {keys}): "
                                 f"name the field with --text_key")
            yield text


def _where(piece: Piece, first: int, index: int) -> str:
    """A line of a JSONL piece, for a message: the line is counted only then (it reads the file up to it)."""
    return f"{piece.path}, line {_line_number(piece, first) + index}"


def _line_number(piece: Piece, offset: int) -> int:
    """1-based line number at byte `offset` of a plain .jsonl (counted once per piece)."""
    if piece.kind != "jsonl" or offset == 0:
        return 1
    count, done = 1, 0
    with open(piece.path, "rb") as f:
        while done < offset:
            block = f.read(min(1 << 24, offset - done))
            count, done = count + block.count(b"\n"), done + len(block)
    return count


def _parquet_file(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading Parquet needs pyarrow: pip install 'megalite[corpora]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise InputError(f"{path} is not a readable Parquet file ({e}): re-export it or leave it out of "
                         f"--input") from None


def _parquet(piece: Piece, text_key: str):
    parquet = _parquet_file(piece.path)
    if text_key not in parquet.schema_arrow.names:
        raise InputError(f"{piece.path}: no text column {text_key!r} (columns: "
                         f"{', '.join(parquet.schema_arrow.names)}): name the column with --text_key")
    for batch in parquet.iter_batches(batch_size=4096, row_groups=[piece.start], columns=[text_key]):
        yield from (t for t in batch.column(0).to_pylist() if t)


def _hf_dataset(spec: str):
    try:
        import datasets
    except ImportError:
        raise InputError(f"{spec}: Hugging Face datasets need the datasets package: pip install "
                         f"'megalite[corpora]'") from None
    name, _, rest = spec[len(HF_PREFIX):].partition(":")
    config, _, split = rest.partition(":")
    try:
        return datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as e:
        raise InputError(f"could not open the Hugging Face dataset {spec} ({type(e).__name__}: {e}): the form is "
                         f"hf:NAME[:CONFIG[:SPLIT]], e.g. hf:HuggingFaceFW/fineweb-edu:sample-10BT:train") from None


def _hf_shards(dataset) -> int:
    return getattr(dataset, "num_shards", None) or dataset.n_shards  # the name before datasets 3.x


def _hf(piece: Piece, text_key: str):
    dataset = _hf_dataset(piece.path)
    shard = dataset.shard(num_shards=_hf_shards(dataset), index=piece.start)
    for row, record in enumerate(shard):
        text = record.get(text_key)
        if not isinstance(text, str):
            raise InputError(f"{piece.path}, shard {piece.start}, row {row}: no text field {text_key!r} (fields: "
                             f"{', '.join(record)}): name the field with --text_key")
        if text:
            yield text

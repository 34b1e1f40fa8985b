"""The token shard format used by this repository: train_gpt.py's reader and the writer.

A shard is a 256-entry little-endian int32 header followed by the tokens as
little-endian uint16:

    header[0] = MAGIC (20240520)
    header[1] = VERSION (1)
    header[2] = number of tokens
    header[3:] = 0

This is the format of the public pre-tokenized FineWeb shards
(`kjj0/fineweb10B-gpt2`) and of the embedded sample in data/sample/. The
trainer, the builders and the downloader all read shards with the functions of
train_gpt.py, so a damaged file is reported the same way everywhere: a
ShardError (train_gpt.DataError) whose message is one line naming the file and
the problem. Tokens must be GPT-2 ids (< 50257) everywhere.
"""

import os
import secrets
import sys

import numpy as np

# The format and its reader live in train_gpt.py, which must stay one self-contained file (it cannot
# import data/); this module re-exports them and adds the writer, so the trainer and every data
# tool accept and reject exactly the same files with the same messages. The price: importing this
# module imports torch (train_gpt's), about a second.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.append(_REPO)
try:
    import train_gpt  # noqa: E402
except ImportError as missing:  # the data tools' scripts end in one line, not a traceback
    raise SystemExit(f"error: the shard checks are train_gpt.py's, which needs {missing.name or missing}: "
                     "pip install -r requirements.txt") from None

MAGIC = train_gpt.SHARD_MAGIC
VERSION = train_gpt.SHARD_VERSION
HEADER_INTS = train_gpt.SHARD_HEADER_INTS
HEADER_BYTES = train_gpt.SHARD_HEADER_BYTES
BOS = train_gpt.BOS_TOKEN  # GPT-2 <|endoftext|>; every document starts with it
GPT2_VOCAB_SIZE = train_gpt.GPT2_VOCAB_SIZE  # tokens must be below this (train_gpt.load_shard's rule)
MAX_TOKENS = 2**31 - 1  # the count is stored in an int32

_HEADER_DTYPE = np.dtype("<i4")
_TOKEN_DTYPE = np.dtype("<u2")

ShardError = train_gpt.DataError  # a malformed shard, or tokens that cannot be stored as one


def shard_name(prefix, index):
    """File name of shard number index: shard 0 is validation, the rest training
    (fineweb_val_000000.bin, fineweb_train_000001.bin, ...)."""
    split = "val" if index == 0 else "train"
    return f"{prefix}_{split}_{index:06d}.bin"


def shard_nbytes(num_tokens):
    """Size in bytes of a complete shard holding num_tokens tokens."""
    return HEADER_BYTES + 2 * num_tokens


def write_shard(path, tokens, vocab_size=GPT2_VOCAB_SIZE):
    """Write tokens (any 1-D integer sequence) to path as a shard.

    The file appears under its final name only when complete: the data goes to
    a temporary file in the same directory, which then replaces path. Tokens
    outside [0, vocab_size) are refused before anything is written, as every
    reader would refuse them (tests of the readers pass vocab_size=2**16).
    """
    path = os.fspath(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ShardError(f"{path}: tokens must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ShardError(f"{path}: tokens must be integers, got dtype {arr.dtype}")
    if arr.size > MAX_TOKENS:
        raise ShardError(f"{path}: {arr.size} tokens do not fit one shard (max {MAX_TOKENS})")
    if arr.size:
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high > 65535:
            bad = low if low < 0 else high
            raise ShardError(f"{path}: token {bad} cannot be stored as uint16 (valid range 0..65535)")
        if high >= vocab_size:  # the readers' rule and wording: the first such token
            first = int(np.argmax(arr >= vocab_size))
            raise ShardError(f"{path}: token {int(arr[first])} at index {first} is >= vocab size {vocab_size}")
    header = np.zeros(HEADER_INTS, dtype=_HEADER_DTYPE)
    header[0], header[1], header[2] = MAGIC, VERSION, arr.size
    directory = os.path.dirname(path) or "."
    # Not tempfile.mkstemp: its 0600 mode would survive the rename; os.open
    # with 0666 lets the umask decide, as for any ordinary file.
    tmp_path = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header.tobytes())
            f.write(arr.astype(_TOKEN_DTYPE, copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        try:
            os.unlink(tmp_path)
        except FileNotFoundError:
            pass
        raise


def read_header(path):
    """Return the token count of the shard at path after checking its header and size."""
    return train_gpt.read_shard_header(os.fspath(path))


def read_shard(path, vocab_size=GPT2_VOCAB_SIZE):
    """Return the tokens of the shard at path as a uint16 array, fully validated.

    Besides the header checks of read_header, every token must be < vocab_size.
    """
    return train_gpt.read_shard_tokens(os.fspath(path), vocab_size).astype(np.uint16, copy=False)

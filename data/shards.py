"""The one reader and writer of the token shard format used by this repository.

A shard is a 256-entry little-endian int32 header followed by the tokens as
little-endian uint16:

    header[0] = MAGIC (20240520)
    header[1] = VERSION (1)
    header[2] = number of tokens
    header[3:] = 0

This is the format of the public pre-tokenized FineWeb shards
(`kjj0/fineweb10B-gpt2`) and of the embedded sample in data/sample/, so the
trainer, the builders and the downloader all go through this module and a
damaged file is reported the same way everywhere: a ShardError whose message
is one line naming the file and the problem.
"""

import os
import secrets

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
BOS = 50256  # GPT-2 <|endoftext|>; every document starts with it
GPT2_VOCAB_SIZE = 50257
MAX_TOKENS = 2**31 - 1  # the count is stored in an int32

_HEADER_DTYPE = np.dtype("<i4")
_TOKEN_DTYPE = np.dtype("<u2")


def shard_name(prefix, index):
    """File name of shard number index: shard 0 is validation, the rest training
    (fineweb_val_000000.bin, fineweb_train_000001.bin, ...)."""
    split = "val" if index == 0 else "train"
    return f"{prefix}_{split}_{index:06d}.bin"


class ShardError(ValueError):
    """A shard file is malformed, or tokens cannot be stored as a shard."""


def shard_nbytes(num_tokens):
    """Size in bytes of a complete shard holding num_tokens tokens."""
    return HEADER_BYTES + 2 * num_tokens


def write_shard(path, tokens):
    """Write tokens (any 1-D integer sequence) to path as a shard.

    The file appears under its final name only when complete: the data goes to
    a temporary file in the same directory, which then replaces path. Tokens
    outside [0, 65535] are refused before anything is written.
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


def _check_header(path, header, file_size):
    """Validate a header against the file size; return the token count."""
    magic, version, count = (int(x) for x in header[:3])
    if magic != MAGIC:
        raise ShardError(f"{path}: bad magic {magic} (expected {MAGIC})")
    if version != VERSION:
        raise ShardError(f"{path}: unsupported version {version} (expected {VERSION})")
    if count < 0:
        raise ShardError(f"{path}: negative token count {count} in header")
    expected = shard_nbytes(count)
    if file_size < expected:
        raise ShardError(
            f"{path}: truncated: header says {count} tokens ({expected} bytes) but the file has {file_size} bytes"
        )
    if file_size > expected:
        raise ShardError(
            f"{path}: {file_size - expected} trailing bytes: header says {count} tokens ({expected} bytes) "
            f"but the file has {file_size} bytes"
        )
    return count


def _read_header_array(path, f):
    raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{path}: too short for a shard header ({len(raw)} bytes, need {HEADER_BYTES})")
    return np.frombuffer(raw, dtype=_HEADER_DTYPE)


def read_header(path):
    """Return the token count of the shard at path after checking its header and size."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        header = _read_header_array(path, f)
        return _check_header(path, header, os.fstat(f.fileno()).st_size)


def read_shard(path, vocab_size=GPT2_VOCAB_SIZE):
    """Return the tokens of the shard at path as a uint16 array, fully validated.

    Besides the header checks of read_header, every token must be < vocab_size.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        header = _read_header_array(path, f)
        count = _check_header(path, header, os.fstat(f.fileno()).st_size)
        tokens = np.fromfile(f, dtype=_TOKEN_DTYPE, count=count)
    if tokens.size != count:  # the file shrank while we were reading it
        raise ShardError(f"{path}: truncated: read {tokens.size} of {count} tokens")
    if count:
        if int(tokens.max()) >= vocab_size:
            where = int(np.argmax(tokens >= vocab_size))
            raise ShardError(f"{path}: token {int(tokens[where])} at index {where} is >= vocab size {vocab_size}")
    return tokens.astype(np.uint16, copy=False)

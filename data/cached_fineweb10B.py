"""Download pre-tokenized FineWeb shards (GPT-2 tokens) from the Hugging Face Hub.

    python data/cached_fineweb10B.py        # val shard + 9 train shards (~2 GB), enough for one speedrun
    python data/cached_fineweb10B.py 103    # all train shards (~20.6 GB)

Files come from the dataset repo kjj0/fineweb10B-gpt2 and land in
data/fineweb10B/. Each is 100M tokens (200 MB + a 1 KB header).

Rerunning is cheap and safe: a file already present and complete (its size
matches its header) is skipped; an incomplete or damaged one is fetched again.
A download goes to data/fineweb10B/.download/ first (huggingface_hub resumes
an interrupted download from there), is validated with data/shards.py, and
only then moved to its final name, so a final name never holds a partial file.

Offline (HF_HUB_OFFLINE=1) or on a network error the script stops with one
line saying what failed and how to retry; files already complete are kept.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_util import (DISK_ERRNOS, OneLineArgumentParser, exit_status, fail, first_line, os_error_text,  # noqa: E402
                      stopped_by_signals)
from shards import ShardError, read_header, read_shard, shard_name, shard_nbytes  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"
DEFAULT_TRAIN_SHARDS = 9  # enough tokens for one speedrun
MAX_TRAIN_SHARDS = 103  # train shards in the repo
DEST_DIR = Path(__file__).resolve().parent / "fineweb10B"
STAGING_NAME = ".download"
SHARD_TOKENS = 100_000_000  # every shard of the repo but the last train shard


class DownloadError(RuntimeError):
    """A download failed; the one-line message says what and how to retry."""


def shard_names(num_train):
    """The validation shard followed by the first num_train training shards."""
    return [shard_name("fineweb", i) for i in range(num_train + 1)]


def hf_fetch(name, staging_dir):
    """Download one file of REPO_ID into staging_dir with huggingface_hub; return its local path.

    huggingface_hub keeps an interrupted download under staging_dir and resumes it.
    """
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise DownloadError("huggingface_hub is not installed: pip install huggingface_hub") from None
    return hf_hub_download(REPO_ID, name, repo_type="dataset", local_dir=staging_dir)


def _offline():
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _place(fetched, final, staging_dir):
    """Put the validated file fetched at final without a partial file ever under that name."""
    if fetched.parent.resolve() == staging_dir.resolve():
        os.replace(fetched, final)  # same directory tree, same filesystem: an atomic rename
        return
    # a fetch that returned a file elsewhere (a cache, a fake hub): copy, never move someone else's file
    tmp = staging_dir / f".{final.name}.copy"
    shutil.copyfile(fetched, tmp)
    os.replace(tmp, final)


def download_shards(names, dest_dir=DEST_DIR, fetch=hf_fetch, log=print):
    """Make every file in names present and complete in dest_dir; return their paths.

    fetch(name, staging_dir) -> path downloads one file (default: hf_fetch);
    tests pass a fake. A fetched file must pass read_shard() before it is
    moved to its final name. Raises DownloadError on the first failure.
    """
    dest_dir = Path(dest_dir)
    staging_dir = dest_dir / STAGING_NAME
    dest_dir.mkdir(parents=True, exist_ok=True)
    found = {name: _shard_state(dest_dir / name) for name in names}   # each header read once
    missing = [name for name in names if not isinstance(found[name], int)]
    needed, free = len(missing) * shard_nbytes(SHARD_TOKENS), shutil.disk_usage(dest_dir).free
    if needed > free:  # now, not at a full disk minutes into the download
        raise DownloadError(f"{dest_dir}: {len(missing)} files to download need {needed / 1e9:.1f} GB, "
                            f"{free / 1e9:.1f} GB are free; free space or ask for fewer shards")
    paths = []
    for number, name in enumerate(names, 1):
        final = dest_dir / name
        tag = f"[{number}/{len(names)}] {final}"
        paths.append(final)
        state = found[name]
        if isinstance(state, int):
            log(f"{tag}: present, {state:,} tokens, skipped")
            continue
        log(f"{tag}: incomplete or damaged ({state}); fetching it again" if state else f"{tag}: downloading")
        staging_dir.mkdir(exist_ok=True)
        try:
            fetched = Path(fetch(name, staging_dir))
        except DownloadError:
            raise
        except Exception as error:
            if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
                raise  # main() says it is the disk's
            if _offline():
                how = "HF_HUB_OFFLINE is set: unset it and rerun to download"
            else:
                how = "check the network and rerun the same command to retry (finished files are kept)"
            raise DownloadError(f"cannot download {name} from {REPO_ID} ({first_line(error)}); {how}") from None
        try:
            read_shard(fetched)
        except ShardError as error:
            if fetched.parent.resolve() == staging_dir.resolve():
                fetched.unlink()  # or huggingface_hub would hand back the same bad file on retry
            raise DownloadError(f"downloaded file is not a valid shard: {error}; rerun to fetch it again") from None
        _place(fetched, final, staging_dir)
    # Every file is in place: what staging holds is huggingface_hub's bookkeeping, and any partial
    # download of a file this run did not ask for (a larger run's, interrupted), fetched anew if asked
    shutil.rmtree(staging_dir, ignore_errors=True)
    return paths


def _shard_state(path):
    """The token count of the shard at path; the ShardError where it is truncated or damaged; None
    where there is no file."""
    if not path.exists():
        return None
    try:
        return read_header(path)
    except ShardError as error:
        return error


def _train_shard_count(text):
    """argparse type for N: an integer from 1 to MAX_TRAIN_SHARDS."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_TRAIN_SHARDS:
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to {MAX_TRAIN_SHARDS}, got {text!r}")
    return value


def main(argv=None, fetch=hf_fetch, dest_dir=DEST_DIR):
    parser = OneLineArgumentParser(
        description=f"Download fineweb_val_000000.bin and the first N train shards of {REPO_ID} into {dest_dir}.")
    parser.add_argument("N", nargs="?", default=DEFAULT_TRAIN_SHARDS, type=_train_shard_count,
                        help=f"number of train shards, 1..{MAX_TRAIN_SHARDS} (default {DEFAULT_TRAIN_SHARDS})")
    args = parser.parse_args(argv)
    try:
        with stopped_by_signals():
            paths = download_shards(shard_names(args.N), dest_dir, fetch)
    except (DownloadError, ShardError) as error:
        fail(str(error))
    except KeyboardInterrupt as interruption:
        fail("interrupted; rerun the same command to resume (finished files are kept)", exit_status(interruption))
    except OSError as error:  # a full disk, a read-only folder, ...
        fail(f"{os_error_text(error)}; free space or fix permissions, then rerun (finished files are kept)")
    size = sum(p.stat().st_size for p in paths)
    print(f"done: {len(paths)} files, {size / 1e9:.2f} GB in {dest_dir}")


if __name__ == "__main__":
    main()

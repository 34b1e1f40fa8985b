"""Build the small embedded sample data/sample/ from English text every Python install has.

    python data/build_sample.py --overwrite     # rebuild data/sample/ in place
    python data/build_sample.py --out /tmp/s    # build elsewhere (e.g. to compare)
    python data/build_sample.py --limit 20 --out /tmp/s   # quick subset (tests)

The trainer and its tests need real text to run without downloading FineWeb.
The text here is CPython's own, under the PSF License Agreement:

  * pydoc_data.topics: the reference-manual topics that help() shows,
    one document per topic;
  * the docstrings and comment blocks of the standard library's .py files,
    read with ast and tokenize (never imported), one document per module
    holding its docstrings and comments in source order.

Long documents are split at paragraph boundaries into chunks of at most
MAX_DOC_CHARS characters, tiny ones (< MIN_DOC_CHARS) are dropped, and exact
duplicates (of documents, and of docstrings/comment blocks across modules)
are kept once. Sources (a topic or a module) are shuffled with a fixed seed
and split between validation and training by whole source, so no text of a
validation document is trained on. Output: sample_val_000000.bin,
sample_train_000001.bin and MANIFEST.json (sizes, sha256, settings).

Everything is deterministic (sorted inputs, fixed seed, no timestamps), but the
input is the running interpreter's standard library, so the shards come out
byte-identical only with the same Python version (a distribution that patches
the stdlib may differ too).
"""

import ast
import contextlib
import errno
import hashlib
import io
import json
import multiprocessing
import os
import platform
import random
import re
import sys
import sysconfig
import tokenize
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_util import (OneLineArgumentParser, WorkerDied, exit_status, fail, interruptions_held,  # noqa: E402
                      leave_signals_to_the_parent, imap_while_workers_live, scratch_folder, stop_pool,
                      stopped_by_signals)
from fineweb import BuildError, get_gpt2_encoding, sha256_of, tokenize_to_shards  # noqa: E402
from shards import ShardError, shard_name  # noqa: E402

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
PREFIX = "sample"
MANIFEST = "MANIFEST.json"
SEED = 20240520
MIN_DOC_CHARS = 500  # ~130 tokens
MAX_DOC_CHARS = 12_000  # ~3k tokens
VAL_TARGET_CHARS = 1_500_000  # ~400k tokens of this text
MAX_SAMPLE_BYTES = 8_000_000  # hard limit for the committed shards together
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root():
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root):
    """The standard library's .py files under root, sorted by relative path (third-party packages excluded)."""
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]
        found.extend(Path(directory) / f for f in files if f.endswith(".py"))
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def module_name(relative):
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or "__init__"


CODING_COOKIE = re.compile(r"^[ \t\f]*#.*?coding[:=]")  # PEP 263


def _comment_blocks(source):
    """(first line, text) of each comment block that reads as prose."""
    blocks, current, last_line = [], [], None
    try:
        for tok in tokenize.tokenize(io.BytesIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            line = tok.start[0]
            if line <= 2 and (tok.string.startswith("#!") or CODING_COOKIE.match(tok.line)):
                continue  # shebang or encoding declaration
            text = tok.string.lstrip("#")
            text = text[1:] if text.startswith(" ") else text
            full_line = tok.line.lstrip().startswith("#")
            # full-line comments on consecutive lines form one block; a comment after code stands alone
            if current and not (full_line and line == last_line + 1):
                blocks.append(current)
                current = []
            current.append((line, text.rstrip()))
            last_line = line if full_line else -1
    except (tokenize.TokenError, SyntaxError):
        pass  # keep what was read before the error
    if current:
        blocks.append(current)
    kept = []
    for block in blocks:
        text = "\n".join(t for _, t in block).strip()
        words = [w for w in text.split() if any(c.isalpha() for c in w)]
        letters = sum(c.isalpha() for c in text)
        visible = len(text) - text.count(" ") - text.count("\n")
        # a few words, mostly letters: drops separators, pragmas and most commented-out code
        if len(words) >= 4 and letters >= 0.6 * visible:
            kept.append((block[0][0], text))
    return kept


def _docstrings(tree):
    """(line, heading, text) of the module, class and function docstrings; the module's heading is empty."""
    found = []

    def visit(node, qualname):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{qualname}.{child.name}" if qualname else child.name
                doc = ast.get_docstring(child)
                if doc:
                    heading = f"class {name}" if isinstance(child, ast.ClassDef) else f"{name}()"
                    found.append((child.lineno, heading, doc))
                visit(child, name)

    doc = ast.get_docstring(tree)
    if doc:
        found.append((0, "", doc))
    visit(tree, "")
    return found


def module_paragraphs(path):
    """[(key, paragraph)]: a module's docstrings and comment blocks in source order.

    key is the docstring or comment text alone, for de-duplication across modules.
    """
    source = path.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escapes and the like in old test files
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return []  # test data that is deliberately not valid Python
    items = [(line, 0, doc, f"{heading}\n\n{doc}" if heading else doc) for line, heading, doc in _docstrings(tree)]
    items += [(line, 1, text, text) for line, text in _comment_blocks(source)]
    return [(key, text) for _, _, key, text in sorted(items, key=lambda item: item[:2])]


def chunk(paragraphs, max_chars=MAX_DOC_CHARS, min_chars=MIN_DOC_CHARS):
    """Pack paragraphs into documents of at most max_chars (a longer paragraph stays whole).

    A short tail is merged into the previous document; documents under
    min_chars are dropped.
    """
    docs, current = [], ""
    for paragraph in paragraphs:
        if current and len(current) + 2 + len(paragraph) > max_chars:
            docs.append(current)
            current = paragraph
        else:
            current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        if docs and len(current) < min_chars:
            docs[-1] = f"{docs[-1]}\n\n{current}"
        else:
            docs.append(current)
    return [d for d in docs if len(d) >= min_chars]


def collect_sources(limit=None, workers=1):
    """[(source name, [documents])]: pydoc topics first, then stdlib modules, each in sorted order.

    limit keeps only the first `limit` topics and the first `limit` modules.
    workers > 1 reads the modules in that many processes (same result).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise BuildError("this Python has no pydoc_data.topics (a stripped-down install?); "
                         "build the sample with a full CPython") from None

    sources = []
    for name in sorted(topics)[:limit]:
        paragraphs = [p.strip() for p in topics[name].split("\n\n") if p.strip()]
        sources.append((f"topic {name}", chunk(paragraphs)))
    root = stdlib_root()
    paths = stdlib_files(root)[:limit]
    if workers > 1:
        pool = multiprocessing.Pool(workers, leave_signals_to_the_parent)
        try:
            per_module = list(imap_while_workers_live(pool, module_paragraphs, paths, 8))
        finally:
            stop_pool(pool)
    else:
        per_module = [module_paragraphs(path) for path in paths]
    seen = set()
    for path, items in zip(paths, per_module):
        # the first module (in sorted order) to hold a docstring or comment keeps it
        paragraphs = [f"Module {module_name(path.relative_to(root))}"]
        for key, text in items:
            if key not in seen:
                seen.add(key)
                paragraphs.append(text)
        sources.append((f"module {path.relative_to(root).as_posix()}", chunk(paragraphs)))
    unique, seen_docs = [], set()
    for name, docs in sources:
        kept = []
        for doc in docs:
            digest = hashlib.sha256(doc.encode()).digest()
            if digest not in seen_docs:
                seen_docs.add(digest)
                kept.append(doc)
        if kept:
            unique.append((name, kept))
    return unique


def split_sources(sources, val_target_chars):
    """Shuffle sources (fixed seed) and take whole ones into val until val_target_chars; rest train."""
    order = list(sources)
    random.Random(SEED).shuffle(order)
    val, train, val_chars = [], [], 0
    for _, docs in order:
        if val_chars < val_target_chars:
            val.extend(docs)
            val_chars += sum(len(d) for d in docs)
        else:
            train.extend(docs)
    return val, train


def build_sample(out_dir=SAMPLE_DIR, limit=None, workers=None, overwrite=False, log=print):
    """Build the sample shards and MANIFEST.json in out_dir; return the manifest dict.

    The files are built in a scratch directory inside out_dir and moved into
    place only when all are complete, so a failed build leaves the old sample.
    """
    out_dir = Path(out_dir)
    targets = [out_dir / shard_name(PREFIX, 0), out_dir / shard_name(PREFIX, 1), out_dir / MANIFEST]
    present = [p for p in targets if p.exists()]
    if present and not overwrite:
        raise BuildError(f"{present[0]} already exists; pass --overwrite to replace the sample, or use --out")
    made = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # deepest first
    manifest = None
    try:
        stack = contextlib.ExitStack()
        try:  # made first: an --out that cannot be written fails before the build. Its own name: a
            # folder of a build still running in --out is not this build's to remove.
            if out_dir.exists() and not out_dir.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            out_dir.mkdir(parents=True, exist_ok=True)
            scratch = stack.enter_context(scratch_folder(out_dir, ".sample-build-", log))
        except OSError as e:
            raise BuildError(f"--out {out_dir}: cannot create a folder there ({e.strerror or e})") from None
        encoding = get_gpt2_encoding()
        sources = collect_sources(limit, workers or os.cpu_count() or 1)
        total_chars = sum(len(d) for _, docs in sources for d in docs)
        val_docs, train_docs = split_sources(sources, min(VAL_TARGET_CHARS, total_chars // 4))
        if not val_docs or not train_docs:
            raise BuildError(f"too little text for a val and a train shard ({len(sources)} sources); raise --limit")
        log(f"{len(sources)} sources, {len(val_docs)} val and {len(train_docs)} train documents, "
            f"{total_chars:,} chars")
        shard_limit = MAX_SAMPLE_BYTES // 2  # tokens: everything of a split goes in one shard
        shards = []
        for first_index, docs in ((0, val_docs), (1, train_docs)):
            written = tokenize_to_shards(docs, scratch, PREFIX, shard_limit, workers,
                                         first_index=first_index, encoding=encoding, log=lambda _: None)
            if len(written) != 1:
                raise BuildError(f"the {'val' if first_index == 0 else 'train'} split does not fit one shard")
            shards.append((written[0], len(docs)))
        total_bytes = sum(path.stat().st_size for (path, _), _ in shards)
        if total_bytes > MAX_SAMPLE_BYTES:
            raise BuildError(f"sample would be {total_bytes:,} bytes, over the {MAX_SAMPLE_BYTES:,} byte limit")
        manifest = _manifest(shards, limit, total_bytes)
        (scratch / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        with interruptions_held():  # a new val shard beside the old train shard would share text
            for (path, _), _ in shards:
                os.replace(path, out_dir / path.name)
            os.replace(scratch / MANIFEST, out_dir / MANIFEST)
    finally:
        stack.close()
        if manifest is None:  # failed (an error, Ctrl-C): the folders this build made go too
            for folder in made:
                try:
                    folder.rmdir()
                except OSError:  # something else put a file there meanwhile: keep it
                    break
    return manifest


def _manifest(shards, limit, total_bytes):
    command = "python data/build_sample.py" + (f" --limit {limit}" if limit else "")
    return {
        "description": "Embedded sample for tests and CPU smoke runs: GPT-2 token shards (data/shards.py format) "
                       "of CPython documentation text, not FineWeb.",
        "sources": [
            "pydoc_data.topics: the Python reference-manual topics shown by help(), one document per topic",
            "docstrings and comment blocks of the standard library .py files (read with ast/tokenize, not "
            "imported), one document per module, files in sorted order",
        ],
        "license": "PSF License Agreement for Python (the Python documentation and standard library source); "
                   "see https://docs.python.org/3/license.html",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "builder": command,
        "reproducibility": "Deterministic: sorted inputs, fixed seed, no timestamps. The input is the running "
                           "interpreter's standard library, so the shards are rebuilt byte-identically only "
                           "with the same Python version.",
        "tokenizer": "GPT-2 BPE (tiktoken 'gpt2', encode_ordinary), each document prefixed by 50256",
        "settings": {"seed": SEED, "min_doc_chars": MIN_DOC_CHARS, "max_doc_chars": MAX_DOC_CHARS,
                     "val_target_chars": VAL_TARGET_CHARS, "limit": limit,
                     "split": "whole sources (topic or module) shuffled with the seed; val takes sources "
                              "until it holds val_target_chars (or a quarter of the text)"},
        "shards": [
            {"file": path.name, "split": "val" if "_val_" in path.name else "train", "documents": docs,
             "tokens": count, "bytes": path.stat().st_size, "sha256": sha256_of(path)}
            for (path, count), docs in shards
        ],
        "total_bytes": total_bytes,
    }


def main(argv=None):
    parser = OneLineArgumentParser(description="Build the embedded sample shards from CPython's own text.")
    parser.add_argument("--out", type=Path, default=SAMPLE_DIR, help="output dir (default data/sample)")
    parser.add_argument("--limit", type=int, default=None,
                        help="use only the first N pydoc topics and N stdlib files (quick test builds)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing sample in the output dir")
    args = parser.parse_args(argv)
    for option, value in (("--limit", args.limit), ("--workers", args.workers)):
        if value is not None and value < 1:
            parser.error(f"{option} must be a positive integer, got {value}")
    try:
        with stopped_by_signals():
            manifest = build_sample(args.out, args.limit, args.workers, args.overwrite)
    except (BuildError, ShardError) as error:
        fail(str(error))
    except WorkerDied as error:
        fail(f"{error}; {args.out} is as it was")
    except KeyboardInterrupt as interruption:
        fail(f"interrupted; {args.out} " + ("holds the new sample, put in place first"
             if getattr(interruption, "came_while_held", False) else "is as it was"), exit_status(interruption))
    for shard in manifest["shards"]:
        print(f"{args.out / shard['file']}: {shard['tokens']:,} tokens, {shard['documents']} documents, "
              f"{shard['bytes']:,} bytes")


if __name__ == "__main__":
    main()

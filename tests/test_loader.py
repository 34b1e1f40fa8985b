"""The data loaders. TrainBatches, the 2025 record's (--train_max_doc_len 0 --train_seq_len_schedule
""): windows start at BOS and follow the record's rule (a step's windows from one shard, shard tails
dropped), ranks never overlap and together see exactly what one rank would see. PackedBatches, the
default (the 2026 record's, against its code in tests/test_record_2026_data.py): a shard too small
for a step is passed over, a step's chunks may end exactly at a shard's end, as set-up's warnings
say. Running out of data and bad files give clear errors; the trainer's shard reader agrees with
data/shards.py."""

import glob
import os

import numpy as np
import pytest
import torch

import train_gpt
from harness import config as cfg
from shards import BOS, write_shard

BOS_WINDOWS = dict(train_max_doc_len=0, train_seq_len_schedule="")  # TrainBatches, the 2025 record's loader


def reference_windows(shards, seq_len, windows_per_step):
    """The record's loader, restated on numpy arrays (its find_batch_starts and generator): before
    each step, while pos + 2 * windows_per_step * seq_len + 1 >= len(shard), move to the next shard
    at pos 0 (the record tests once, so a shard too small for a step would start one: the same on
    shards with room); each window starts at the first BOS >= pos, and pos moves on to the first
    BOS >= start + seq_len. Yields (shard index, start, window)."""
    out, shard_index, pos = [], 0, 0
    bos = [np.flatnonzero(t == BOS) for t in shards]
    while True:
        if len(out) % windows_per_step == 0:
            while pos + 2 * windows_per_step * seq_len + 1 >= len(shards[shard_index]):
                shard_index, pos = shard_index + 1, 0
                if shard_index == len(shards):
                    return out
        tokens, starts = shards[shard_index], bos[shard_index]
        start = int(starts[np.searchsorted(starts, pos)])
        assert start + seq_len + 1 <= len(tokens), "a step outgrew its budget: not exercised here"
        out.append((shard_index, start, tokens[start:start + seq_len + 1]))
        later = starts[starts >= start + seq_len]
        pos = int(later[0]) if len(later) else len(tokens)


def drain(loader):
    out = []
    while True:
        try:
            inputs, targets = loader.next_batch(torch.device("cpu"), loader.seq_len)
        except train_gpt.DataExhausted:
            return out
        out.append((inputs, targets))


@pytest.mark.parametrize("windows_per_step", [1, 3])
def test_windows_follow_the_records_rule_and_drop_shard_tails(make_shards, windows_per_step):
    train_glob, _, (trains, _) = make_shards(train_sizes=(5_000, 3_000, 4_000), max_len=150)
    files = train_gpt.find_shards(train_glob, "training")
    seq_len = 256
    expected = reference_windows(trains, seq_len, windows_per_step)
    loader = train_gpt.TrainBatches(files, seq_len, rank=0, world_size=1,
                                    windows_per_step=windows_per_step)
    got = drain(loader)
    loader.close()
    assert len(got) == len(expected) > 20
    assert len({shard for shard, _, _ in expected}) == 3  # every shard contributes
    for (inputs, targets), (_, _, window) in zip(got, expected):
        assert inputs[0].item() == BOS
        assert torch.equal(inputs, torch.from_numpy(window[:-1]).long())
        assert torch.equal(targets, torch.from_numpy(window[1:]).long())
    # Inside a shard, the tokens skipped between windows hold no BOS: only document tails are
    # skipped, never a whole document. A shard's tail is dropped only at a step boundary.
    for i, ((shard_a, a, _), (shard_b, b, _)) in enumerate(zip(expected, expected[1:])):
        if shard_a == shard_b:
            assert b >= a + seq_len and BOS not in trains[shard_a][a + seq_len:b]
        else:
            assert (i + 1) % windows_per_step == 0
    assert loader.windows_taken == len(expected)


@pytest.mark.parametrize("sizes", [(5_000, 600, 4_000), (5_000, 1_500, 5_000), (5_000, 600)])
def test_a_shard_too_small_for_a_step_is_passed_over(make_shards, tmp_path, sizes):
    """A step moves on from a shard without room for it to the next shard that has room: every
    shard it moves to is tested (one too small used to start a step that ended in the next shard,
    or in no shard at all, the data running out mid-step). A shard without a BOS is passed over
    the same way."""
    train_glob, _, (trains, _) = make_shards(train_sizes=sizes, max_len=150)
    files = train_gpt.find_shards(train_glob, "training")
    seq_len, per_step = 256, 3
    expected = reference_windows(trains, seq_len, per_step)
    loader = train_gpt.TrainBatches(files, seq_len, rank=0, world_size=1, windows_per_step=per_step)
    got = [inputs for inputs, _ in drain(loader)]
    loader.close()
    assert len(got) == len(expected) and len(got) % per_step == 0 and loader.windows_taken == len(got)
    for inputs, (_, _, window) in zip(got, expected):
        assert torch.equal(inputs, torch.from_numpy(window[:-1]).long())
    # set-up names it in a warning, before anything starts
    args = train_gpt.Hyperparameters(micro_batches=per_step, train_seq_len=seq_len, num_iterations=1, **BOS_WINDOWS)
    assert cfg.data_shortfall(files, args) == [
        f"warning: 1 training shard(s) hold at most 1,537 tokens, too few for a step (2 x micro_batches x "
        f"train_seq_len + 1), and are passed over, the first {files[1]}"]
    no_bos = tmp_path / "nobos_train_000002.bin"  # between the first shard and the last
    write_shard(no_bos, np.full(4_000, 13))
    with_no_bos = [files[0], str(no_bos), files[-1]]
    passed_over = drain(train_gpt.TrainBatches(with_no_bos, seq_len, 0, 1, windows_per_step=per_step))
    left_out = drain(train_gpt.TrainBatches([files[0], files[-1]], seq_len, 0, 1, windows_per_step=per_step))
    assert len(passed_over) == len(left_out) > 0
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(passed_over, left_out))


def test_a_step_whose_room_ends_exactly_at_the_shards_end_moves_to_the_next_shard(tmp_path):
    """The record's room test is strict: a step starts in a shard only where its position plus
    2 x windows_per_step x seq_len + 1 tokens ends before the shard does; where it ends exactly at
    the shard's end the step moves on. Random shards never hit that equality, so these are built
    to: the first holds exactly a step's room from its start, the second exactly a step's room from
    its second document's BOS (its first step fits, its second does not); the third has room to
    spare. The loader and data_shortfall must draw the same line (a shard of exactly the room is
    one too small)."""
    seq_len, per_step = 8, 1
    room = 2 * per_step * seq_len + 1  # 17
    ids = iter(range(1, 1000))  # every token but BOS differs: a window's tokens say where it came from

    def documents(*lengths):
        return np.array([t for n in lengths for t in [BOS] + [next(ids) for _ in range(n - 1)]])
    shards = [documents(room), documents(seq_len, room), documents(*[seq_len] * 12)]
    assert [len(s) for s in shards] == [room, seq_len + room, 12 * seq_len]
    files = []
    for i, tokens in enumerate(shards):
        files.append(str(tmp_path / f"edge_train_{i:06d}.bin"))
        write_shard(files[-1], tokens)
    expected = reference_windows(shards, seq_len, per_step)
    # the first shard starts no step; the second starts one, at 0, and none at its BOS at seq_len
    assert [(shard, start) for shard, start, _ in expected[:3]] == [(1, 0), (2, 0), (2, seq_len)]
    loader = train_gpt.TrainBatches(files, seq_len, rank=0, world_size=1, windows_per_step=per_step)
    got = [inputs for inputs, _ in drain(loader)]
    loader.close()
    for inputs, (_, _, window) in zip(got, expected):
        assert inputs.tolist() == window[:-1].tolist()
    assert len(got) == len(expected)
    args = train_gpt.Hyperparameters(micro_batches=per_step, train_seq_len=seq_len, num_iterations=1, **BOS_WINDOWS)
    assert cfg.data_shortfall(files, args) == [
        f"warning: 1 training shard(s) hold at most {room} tokens, too few for a step (2 x micro_batches x "
        f"train_seq_len + 1), and are passed over, the first {files[0]}"]


def drain_packed(files, seq_len, per_step, max_doc_len=2048):
    """Each chunk (seq_len + 1 tokens) a PackedBatches loader yields, at world size 1, and the loader."""
    loader, chunks = train_gpt.PackedBatches(files, max_doc_len, 0, 1, chunks_per_step=per_step), []
    try:
        while True:
            inputs, targets = loader.next_batch(torch.device("cpu"), seq_len)
            chunks.append(torch.cat([inputs, targets[-1:]]))
    except train_gpt.DataExhausted:
        return chunks, loader
    finally:
        loader.close()


@pytest.mark.parametrize("sizes", [(5_000, 600, 4_000), (5_000, 600)])
def test_a_shard_too_small_for_a_packed_step_is_passed_over(make_shards, tmp_path, sizes):
    """The default loader: a step's chunks come from one shard, so one holding fewer tokens than a
    step's chunks (here 600 < 3 x 257) starts none; the stream is the one without it, the last
    shard's too (then the data runs out at a step's end). set-up names it, by the loader's rule. A
    shard without a BOS is passed over the same way."""
    train_glob, _, _ = make_shards(train_sizes=sizes, max_len=150)
    files = train_gpt.find_shards(train_glob, "training")
    seq_len, per_step = 256, 3
    got, loader = drain_packed(files, seq_len, per_step)
    without, _ = drain_packed(files[:1] + files[2:], seq_len, per_step)
    assert len(got) == len(without) > 3 * per_step and len(got) % per_step == 0 and loader.chunks_taken == len(got)
    assert all(torch.equal(a, b) for a, b in zip(got, without))
    args = train_gpt.Hyperparameters(micro_batches=per_step, train_seq_len=seq_len, train_seq_len_schedule="",
                                     num_iterations=1)
    assert cfg.data_shortfall(files, args) == [
        f"warning: 1 training shard(s) hold at most 770 tokens, too few for a step (micro_batches x (train_seq_len "
        f"+ 1) - 1), and are passed over, the first {files[1]}"]
    no_bos = tmp_path / "nobos_train_000002.bin"
    write_shard(no_bos, np.full(4_000, 13))
    passed_over, _ = drain_packed([files[0], str(no_bos), files[-1]], seq_len, per_step)
    left_out, _ = drain_packed([files[0], files[-1]], seq_len, per_step)
    assert len(passed_over) == len(left_out) > 0 and all(torch.equal(a, b) for a, b in zip(passed_over, left_out))


def test_a_packed_step_may_end_exactly_at_the_shards_end(tmp_path):
    """The default loader's room is its chunks' tokens, nothing more: a step of 2 chunks of 9 tokens
    (seq_len 8) fits in a shard of exactly 18 tokens, or in the last 18 tokens after the previous
    step; 17 tokens start none, from a shard's start (its first chunk is dropped with the step) or
    after a step. Every token but BOS differs, so a chunk says where it came from; data_shortfall
    draws the loader's line (a shard of 17 tokens is too small, one of 18 is not)."""
    seq_len, per_step = 8, 2
    ids = iter(range(1, 1000))

    def documents(*lengths):
        return np.array([t for n in lengths for t in [BOS] + [next(ids) for _ in range(n - 1)]])
    shards = [documents(9, 8),               # 17 tokens: a chunk, not a step
              documents(4, 5, 9),            # exactly a step: two documents packed into a chunk, then one
              documents(9, 9, 3, 6, 9),      # a step, then one that ends exactly at the shard's end
              documents(9, 9, 9, 8),         # a step, then 17 tokens: the next step moves on
              documents(*[9] * 4)]           # two steps
    files = []
    for i, tokens in enumerate(shards):
        files.append(str(tmp_path / f"edge_train_{i:06d}.bin"))
        write_shard(files[-1], tokens)
    got, _ = drain_packed(files, seq_len, per_step, max_doc_len=16)
    expected = [(1, 0), (1, 9), (2, 0), (2, 9), (2, 18), (2, 27), (3, 0), (3, 9)] + [(4, 9 * k) for k in range(4)]
    assert [chunk.tolist() for chunk in got] == [shards[i][start:start + 9].tolist() for i, start in expected]
    args = train_gpt.Hyperparameters(micro_batches=per_step, train_seq_len=seq_len, train_max_doc_len=16,
                                     train_seq_len_schedule="", num_iterations=1)
    assert cfg.data_shortfall(files, args) == [
        f"warning: 1 training shard(s) hold at most 17 tokens, too few for a step (micro_batches x (train_seq_len "
        f"+ 1) - 1), and are passed over, the first {files[0]}"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_split_the_same_windows_without_overlap(make_shards, world_size):
    train_glob, _, (trains, _) = make_shards(train_sizes=(6_000, 6_000))
    files = train_gpt.find_shards(train_glob, "training")
    seq_len, per_step = 128, 2 * world_size
    single = [x for x, _ in drain(train_gpt.TrainBatches(files, seq_len, 0, 1, windows_per_step=per_step))]
    per_rank = [[x for x, _ in drain(train_gpt.TrainBatches(files, seq_len, r, world_size,
                                                             windows_per_step=per_step))]
                for r in range(world_size)]
    reference = reference_windows(trains, seq_len, per_step)
    # the one-rank stream is the record's, whole steps of it; each rank takes its share of each step
    assert [x.tolist() for x in single] == [window[:-1].tolist() for _, _, window in reference]
    assert len(single) % per_step == 0 and all(len(mine) == len(single) // world_size for mine in per_rank)
    steps = len(single) // world_size
    assert steps >= 10
    for step in range(steps):
        for r in range(world_size):
            assert torch.equal(per_rank[r][step], single[step * world_size + r])
    # windows are disjoint stretches of the stream: no two ranks read the same tokens
    starts = [(shard, start) for shard, start, _ in reference]
    assert all(sb != sa or b - a >= seq_len for (sa, a), (sb, b) in zip(starts, starts[1:]))


@pytest.mark.parametrize("packed", [True, False])
def test_running_out_of_data_says_what_to_do(make_shards, packed):
    train_glob, _, _ = make_shards(train_sizes=(2_000,))
    files = train_gpt.find_shards(train_glob, "training")
    loader = train_gpt.PackedBatches(files, 2048, 0, 1) if packed else train_gpt.TrainBatches(files, 256, 0, 1)
    with pytest.raises(train_gpt.DataExhausted) as err:
        for _ in range(100):
            loader.next_batch(torch.device("cpu"), 256)
    loader.close()
    assert "cached_fineweb10B.py" in str(err.value) and "\n" not in str(err.value)


def test_validation_windows_cover_val_tokens_once(make_shards):
    _, val_glob, (_, val) = make_shards(val_size=5_000)
    files = train_gpt.find_shards(val_glob, "validation")
    tokens = train_gpt.load_val_tokens(files, 4096)
    assert tokens.dtype == torch.uint16 and tokens.tolist() == val[:4097].tolist()
    seen = []
    for rank in range(2):
        for inputs, targets in train_gpt.val_batches(tokens, 512, rank, 2, torch.device("cpu")):
            assert torch.equal(targets[:-1], inputs[1:])
            seen.append(inputs)
    assert sum(x.numel() for x in seen) == 4096
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.sort(tokens[:4096].to(torch.int64)).values)


def test_validation_is_shared_by_uneven_ranks(make_shards):
    _, val_glob, _ = make_shards(val_size=3_000)
    tokens = train_gpt.load_val_tokens(train_gpt.find_shards(val_glob, "validation"), 2560)
    per_rank = [list(train_gpt.val_batches(tokens, 512, r, 3, torch.device("cpu"))) for r in range(3)]
    assert [len(batches) for batches in per_rank] == [2, 2, 1]  # 5 windows over 3 ranks
    starts = sorted(int(torch.nonzero(torch.all(tokens[:2560].to(torch.int64).unfold(0, 512, 512) == x, dim=1))[0])
                    for batches in per_rank for x, _ in batches)
    assert starts == [0, 1, 2, 3, 4]


def test_trainer_reader_agrees_with_data_writer(tmp_path):
    tokens = np.array([BOS, 1, 2, 50256, 0, BOS, 7], dtype=np.int64)
    path = tmp_path / "x.bin"
    write_shard(path, tokens)
    assert train_gpt.read_shard_header(str(path)) == len(tokens)
    assert train_gpt.load_shard(str(path)).tolist() == tokens.tolist()


@pytest.mark.parametrize("token", [50257, 50303, 60000])
def test_trainer_and_data_tools_share_one_token_rule(tmp_path, token):
    """Ids in the padding of the model's vocabulary are not GPT-2 tokens: the trainer (every entry
    point) and data/shards.py reject them with the same line."""
    import shards
    path = tmp_path / "pad.bin"
    write_shard(path, [BOS, 5, token, 3], vocab_size=2**16)  # what no data tool writes
    expected = f"{path}: token {token} at index 2 is >= vocab size 50257"
    for read in (lambda: train_gpt.load_shard(str(path)),
                 lambda: train_gpt.load_val_tokens([str(path)], 3),
                 lambda: train_gpt.read_shard_tokens(str(path)),
                 lambda: shards.read_shard(path)):
        with pytest.raises(train_gpt.DataError) as err:
            read()
        assert str(err.value) == expected
    assert shards.ShardError is train_gpt.DataError


def corrupt(path, how):
    raw = bytearray(path.read_bytes())
    if how == "magic":
        raw[0:4] = (12345).to_bytes(4, "little")
    elif how == "version":
        raw[4:8] = (7).to_bytes(4, "little")
    elif how == "truncated":
        raw = raw[:-2]
    elif how == "short":
        raw = raw[:100]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how, needle", [("magic", "not a shard: bad magic 12345"),
                                         ("version", "unsupported version 7"),
                                         ("truncated", "but the file has"), ("short", "too short")])
def test_bad_shards_fail_with_one_line_naming_the_file(tmp_path, how, needle):
    path = tmp_path / "bad.bin"
    write_shard(path, np.arange(10))
    corrupt(path, how)
    with pytest.raises(train_gpt.DataError) as err:
        train_gpt.load_shard(str(path))
    message = str(err.value)
    assert message.startswith(str(path)) and needle in message and "\n" not in message


def test_out_of_range_token_is_reported(tmp_path):
    path = tmp_path / "big.bin"
    write_shard(path, [BOS, 5, 60000, 3], vocab_size=2**16)
    with pytest.raises(train_gpt.DataError, match=r"big.bin: token 60000 at index 2 is >= vocab size 50257"):
        train_gpt.load_shard(str(path))


def test_missing_shards_name_the_pattern(tmp_path):
    with pytest.raises(train_gpt.DataError, match="no training shards match"):
        train_gpt.find_shards(str(tmp_path / "nothing_*.bin"), "training")


@pytest.mark.skipif(bool(glob.glob(os.path.join(train_gpt.REPO_DIR, train_gpt.FINEWEB_FILES[0]))),
                    reason="FineWeb is downloaded here")
def test_one_data_option_given_keeps_the_other_default_in_the_repository(tmp_path, make_shards, monkeypatch):
    """--val_files alone: no fallback to the sample (that needs both unset), and the default training
    path is the repository's, not the working directory's."""
    _, val_glob, _ = make_shards()
    monkeypatch.chdir(tmp_path)
    args = cfg.parse_config(["--preset", "cpu", f"--val_files={val_glob}"], {}, 1)
    with pytest.raises(train_gpt.DataError) as err:
        train_gpt.resolve_data_files(args)
    assert str(err.value).startswith(os.path.join(train_gpt.REPO_DIR, train_gpt.FINEWEB_FILES[0]) + ": no training")


def test_next_shard_is_read_by_a_background_thread(make_shards, monkeypatch):
    import threading
    train_glob, _, _ = make_shards(train_sizes=(3_000, 3_000))
    readers = []
    original = train_gpt.LoadedShard.__init__

    def recording_init(self, path, pin_memory):
        readers.append((path, threading.current_thread() is threading.main_thread()))
        original(self, path, pin_memory)
    monkeypatch.setattr(train_gpt.LoadedShard, "__init__", recording_init)
    loader = train_gpt.TrainBatches(train_gpt.find_shards(train_glob, "training"), 128, 0, 1)
    loader._prefetch.result()  # the second shard is loaded without anyone asking for it yet
    assert [main for _, main in readers] == [True, False]
    drain(loader)
    loader.close()


def test_a_loader_started_from_a_state_continues_the_stream_reading_each_shard_once(make_shards, monkeypatch):
    """Resuming: the loader opens at the checkpoint's shard (the earlier shards are not read) and
    yields exactly what the uninterrupted loader yields from there."""
    train_glob, _, _ = make_shards(train_sizes=(3_000, 3_000, 3_000))
    files = train_gpt.find_shards(train_glob, "training")
    whole = train_gpt.TrainBatches(files, 128, 0, 1, windows_per_step=2)
    head = []
    while whole.state()["shard"] == 0 or len(head) % 2:   # into the second shard, at a step's start
        head.append(whole.next_batch(torch.device("cpu"), whole.seq_len)[0])
    state = whole.state()
    rest = [x for x, _ in drain(whole)]
    whole.close()
    read = []
    original = train_gpt.LoadedShard.__init__

    def recording_init(self, path, pin_memory):
        read.append(os.path.basename(path))
        original(self, path, pin_memory)
    monkeypatch.setattr(train_gpt.LoadedShard, "__init__", recording_init)
    resumed = train_gpt.TrainBatches(files, 128, 0, 1, windows_per_step=2, start=state)
    resumed_rest = [x for x, _ in drain(resumed)]
    resumed.close()
    assert state["shard"] == 1 and state["file"] == os.path.basename(files[1]) and len(rest) > 4
    assert read == [os.path.basename(f) for f in files[1:]]
    assert len(resumed_rest) == len(rest) and all(torch.equal(a, b) for a, b in zip(resumed_rest, rest))
    assert resumed.windows_taken == whole.windows_taken


def test_data_running_out_mid_step_leaves_the_position_where_that_step_began(make_shards):
    """Documents longer than a window's budget make a step's windows outgrow the room tested at
    its start, so the last shard can run out mid-step. The loader's state is then where that step
    began: resumed with one more shard, it yields what a loader over all of them yields from that
    step on (a mid-step position would shift every later step's windows)."""
    train_glob, _, _ = make_shards(train_sizes=(3_000, 3_000, 3_000), max_len=400)
    files = train_gpt.find_shards(train_glob, "training")
    seq_len, per_step = 32, 3   # each window takes a document, about 200 tokens: over its budget of 64
    short = train_gpt.TrainBatches(files[:2], seq_len, 0, 1, windows_per_step=per_step)
    taken = len(drain(short))
    state = short.state()
    short.close()
    assert taken % per_step != 0, "the data must run out mid-step for this test"
    assert state["windows_taken"] == taken - taken % per_step and state["shard"] == 1
    whole = [x for x, _ in drain(train_gpt.TrainBatches(files, seq_len, 0, 1, windows_per_step=per_step))]
    resumed = [x for x, _ in drain(train_gpt.TrainBatches(files, seq_len, 0, 1, windows_per_step=per_step,
                                                          start=state))]
    assert len(resumed) == len(whole) - state["windows_taken"] > per_step
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole[state["windows_taken"]:]))

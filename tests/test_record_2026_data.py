"""The port to the record of 2026-01-19: its training batches (documents from BOS tokens, each cut
at a maximum length, packed into chunks of exactly n + 1 tokens, the batch size changing by
stage) and its bigram hash, against restatements of the record's code
(../shared/peers/modded-nanogpt_93f0e6b9/train_gpt.py, lines named beside each). The record
fills a step in one call at 8 GPUs; ours must give those chunks at every world size."""

import dataclasses

import numpy as np
import pytest
import torch

import train_gpt
from conftest import synthetic_documents
from shards import BOS, write_shard

CPU = torch.device("cpu")


def record_step_chunks(shards, chunk_lengths, max_doc_len, chunks_per_step=8):
    """The record's BOSFinder.next_batch (P 1353-1379) and distributed_data_generator (P 1421-1457)
    at 8 GPUs (one call fills a step's 8 chunks), restated on numpy arrays: chunk r takes documents
    from successive BOS positions, each ending at the next BOS (the shard's end after the last),
    max_doc_len tokens on, or where the chunk has n + 1 tokens; the next chunk starts at the next
    BOS. A step that runs out of BOS positions starts afresh on the next shard (StopIteration); the
    files are not cycled. chunk_lengths: n of each step. Returns each step's chunks."""
    shard, doc, steps = 0, 0, []
    bos = [np.flatnonzero(t == BOS) for t in shards]
    for n in chunk_lengths:
        while True:
            idx, chunks, ok = doc, [], True
            for _ in range(chunks_per_step):
                parts, cur_len = [], 0
                while cur_len <= n:
                    if idx >= len(bos[shard]):
                        ok = False
                        break
                    cur = bos[shard][idx]
                    end = min(bos[shard][idx + 1] if idx + 1 < len(bos[shard]) else len(shards[shard]),
                              cur + max_doc_len, cur + n - cur_len + 1)
                    parts.append(shards[shard][cur:end])
                    cur_len += end - cur
                    idx += 1
                if not ok:
                    break
                assert cur_len == n + 1
                chunks.append(np.concatenate(parts))
            if ok:
                doc = idx
                steps.append(chunks)
                break
            shard, doc = shard + 1, 0
            if shard == len(shards):
                return steps
    return steps


def shards_in(tmp_path, sizes, seed=0, max_len=300):
    rng = np.random.default_rng(seed)
    streams = [synthetic_documents(rng, size, max_len=max_len) for size in sizes]
    for i, tokens in enumerate(streams):
        write_shard(tmp_path / f"t_{i:06d}.bin", tokens)
    return sorted(str(p) for p in tmp_path.glob("t_*.bin")), streams


def our_steps(files, chunk_lengths, max_doc_len, world_size, chunks_per_step=8, start=None):
    """Every rank's loader at this world size; step s's chunks in global order (micro-step m, rank
    r: chunk m * world_size + r). Stops where the data runs out."""
    loaders = [train_gpt.PackedBatches(files, max_doc_len, r, world_size, chunks_per_step=chunks_per_step, start=start)
               for r in range(world_size)]
    steps = []
    try:
        for n in chunk_lengths:
            chunks = [None] * chunks_per_step
            for m in range(chunks_per_step // world_size):
                for r, loader in enumerate(loaders):
                    inputs, targets = loader.next_batch(CPU, n)
                    assert inputs.shape == targets.shape == (n,) and torch.equal(inputs[1:], targets[:-1])
                    chunks[m * world_size + r] = torch.cat([inputs, targets[-1:]]).numpy()
            steps.append(chunks)
    except train_gpt.DataExhausted:
        pass
    finally:
        for loader in loaders:
            loader.close()
    return steps, loaders


def assert_same_steps(ours, record):
    assert len(ours) == len(record)
    for s, (a, b) in enumerate(zip(ours, record)):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b)), f"step {s}"


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_chunks_are_the_records_at_every_world_size_through_stage_changes_and_shard_ends(tmp_path, world_size):
    # documents up to 300 tokens, cut at 96; chunks of 64, 128 and 192 tokens (three stages, as the
    # record's 16384/32768/49152 per GPU); three shards, each ending in the middle of a step
    files, streams = shards_in(tmp_path, [12_000, 9_000, 20_000])
    lengths = [64] * 4 + [128] * 4 + [192] * 12
    record = record_step_chunks(streams, lengths, max_doc_len=96)
    assert 10 < len(record) < len(lengths)  # the data runs out before the schedule: its end is exercised too
    ours, _ = our_steps(files, lengths, max_doc_len=96, world_size=world_size)
    assert_same_steps(ours, record)
    # every chunk starts with a BOS, no document part is longer than 96 tokens, chunks never overlap
    for chunk in (c for step in ours for c in step):
        starts = np.flatnonzero(chunk == BOS)
        assert starts[0] == 0 and np.diff(np.append(starts, len(chunk))).max() <= 96


def test_a_step_that_does_not_fit_in_a_shard_starts_afresh_on_the_next(tmp_path):
    """The record at 8 GPUs drops a whole step's partial chunks at a shard's end (not only the
    chunk that ran out), which our loader must do at world size 1 too, where each chunk is its
    own call."""
    files, streams = shards_in(tmp_path, [3_000, 3_000])
    record = record_step_chunks(streams, [128] * 10, max_doc_len=2048)
    ours, _ = our_steps(files, [128] * 10, max_doc_len=2048, world_size=1)
    assert_same_steps(ours, record)
    first_of_second_shard = next(s for s, step in enumerate(record) if np.array_equal(step[0][:50], streams[1][:50]))
    # the first shard had room for more chunks than its whole steps took: a partial step was dropped
    chunks_in_first = len(record_step_chunks(streams[:1], [128] * 40, max_doc_len=2048, chunks_per_step=1))
    assert 8 * first_of_second_shard < chunks_in_first < 8 * (first_of_second_shard + 1)


@pytest.mark.parametrize("world_size", [1, 8])
def test_edge_shards_are_read_as_the_record_reads_them(tmp_path, world_size):
    """A shard without a BOS (passed over), tokens before a shard's first BOS (skipped), a BOS as a
    shard's last token (a one-token document), documents exactly a chunk long or exactly
    max_doc_len long: the record's chunks, at world sizes 1 and 8."""
    rng = np.random.default_rng(1)
    n, max_doc_len = 32, 40
    ids = iter(range(1, 10**6))  # no token repeats: a chunk's tokens say where they came from

    def documents(*lengths):
        return [t for length in lengths for t in [BOS] + [next(ids) for _ in range(length - 1)]]
    streams = [
        np.array([next(ids) for _ in range(500)]),                                        # no BOS at all
        np.array([next(ids) for _ in range(7)] + documents(n + 1, n + 1, 5, max_doc_len, 90, n + 1) * 1
                 + documents(*rng.integers(3, 60, 30)) + [BOS]),                         # ends in a lone BOS
        np.array(documents(*[n + 1] * 20, 1)),                                            # chunk-long documents
        np.array(documents(*rng.integers(1, 80, 40))),                                    # one-token documents too
    ]
    files = []
    for i, tokens in enumerate(streams):
        files.append(str(tmp_path / f"e_{i:06d}.bin"))
        write_shard(files[-1], tokens)
    lengths = [n] * 12
    record = record_step_chunks(streams, lengths, max_doc_len=max_doc_len)
    assert len(record) >= 4  # every shard with a BOS gives at least one step
    ours, _ = our_steps(files, lengths, max_doc_len=max_doc_len, world_size=world_size)
    assert_same_steps(ours, record)
    assert np.array_equal(ours[0][0], streams[1][7:7 + n + 1])  # the first chunk: exactly the first document


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_resumed_loader_continues_the_stream_from_a_steps_start(tmp_path, world_size):
    files, streams = shards_in(tmp_path, [9_000, 9_000])
    lengths = [64] * 6 + [128] * 6
    whole, _ = our_steps(files, lengths, max_doc_len=96, world_size=world_size)
    head, loaders = our_steps(files, lengths[:7], max_doc_len=96, world_size=world_size)
    states = [loader.state() for loader in loaders]
    assert all(state == states[0] for state in states)  # every rank holds the same position
    tail, _ = our_steps(files, lengths[7:], max_doc_len=96, world_size=world_size, start=states[0])
    assert_same_steps(head + tail, whole)
    # mid-step (data ran out, or a checkpoint of a stopped step): the step's start
    loader = train_gpt.PackedBatches(files, 96, 0, 1, chunks_per_step=8, start=states[0])
    loader.next_batch(CPU, 128)
    assert loader.state() == states[0]
    loader.close()


def test_a_batch_schedule_without_packed_documents_is_refused_in_one_line():
    config = train_gpt.harness("config")
    with pytest.raises(train_gpt.ConfigError) as error:
        config.parse_config(["--preset=cpu", "--train_max_doc_len=0", "--train_seq_len_schedule=512,1024"], {},
                            world_size=1, cuda_available=False)
    assert str(error.value) == ("--train_seq_len_schedule='512,1024': needs packed documents (--train_max_doc_len, "
                                "e.g. 2048): windows from a BOS keep one length")
    with pytest.raises(train_gpt.ConfigError, match=r"^--train_seq_len_schedule='512,1000': each length must be a "
                                                    r"multiple of attn_block_size=64$"):
        config.parse_config(["--preset=cpu", "--train_seq_len_schedule=512,1000"], {},  # (packed: the preset's)
                            world_size=1, cuda_available=False)


def record_bigram_hash(x, bigram_vocab_size):  # P 1406-1419 (get_bigram_hash), on an int32 tensor
    rand_int_1, rand_int_2, mod = 36313, 27191, bigram_vocab_size - 1
    x = x.to(torch.int32).clone()
    x[0] = mod
    x[1:] = torch.bitwise_xor(rand_int_1 * x[1:], rand_int_2 * x[:-1]) % mod
    return x


def test_bigram_hash_is_the_records():
    table = 50304 * 5  # bigram_vocab_size = 50304 * 5
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50304, (4096,), generator=gen)
    tokens[:6] = torch.tensor([BOS, 50303, 50303, 0, 50256, 1])  # extremes: the largest products, zero
    ids = train_gpt.bigram_hash(tokens, table)
    assert torch.equal(ids, record_bigram_hash(tokens, table)) and ids.dtype == torch.int32
    assert ids[0] == table - 1 and ids[1:].min() >= 0 and ids[1:].max() < table - 1  # the last row is position 0's
    assert int(ids[2]) == ((36313 * 50303) ^ (27191 * 50303)) % (table - 1)  # no int32 overflow for token ids
    # position 1 hashes with position 0's reserved id, whose product wraps in int32 (as the record's does)
    wrapped = (27191 * (table - 1) + 2 ** 31) % 2 ** 32 - 2 ** 31
    assert int(ids[1]) == ((36313 * 50303) ^ wrapped) % (table - 1)


def test_set_up_judges_the_shards_stage_by_stage_of_a_batch_schedule(tmp_path):
    """A shard too small for a later stage's step still trains the earlier stages: a warning names
    the step from which it is passed over, or from which no shard has room (training stops there);
    only where no shard has room for the first stage's step is it an error."""
    config = train_gpt.harness("config")
    files, _ = shards_in(tmp_path, [300, 700, 5_000])
    args = train_gpt.Hyperparameters(micro_batches=4, train_max_doc_len=96, num_iterations=6, extension_steps=0,
                                     train_seq_len_schedule="64,128,256")  # rooms 259, 515, 1027
    assert config.data_shortfall(files, args) == [
        f"warning: 1 training shard(s) hold at most 515 tokens, too few for a step from step 2 (train_seq_len 128) "
        f"(micro_batches x (train_seq_len + 1) - 1), and are passed over, the first {files[0]}",
        f"warning: 1 training shard(s) hold at most 1,027 tokens, too few for a step from step 4 (train_seq_len 256) "
        f"(micro_batches x (train_seq_len + 1) - 1), and are passed over, the first {files[1]}"]
    assert config.data_shortfall(files[:2], args) == [
        f"warning: 1 training shard(s) hold at most 515 tokens, too few for a step from step 2 (train_seq_len 128) "
        f"(micro_batches x (train_seq_len + 1) - 1), and are passed over, the first {files[0]}",
        "warning: no training shard holds more than 1,027 tokens (4 x (256 + 1) - 1), a step from step 4 "
        "(train_seq_len 256): training will stop there",
        "warning: the 2 training shard(s) hold 1,000 tokens but 6 steps need at least 3,584; training will stop "
        "early (`python data/cached_fineweb10B.py N` downloads more)"]
    with pytest.raises(train_gpt.DataError, match=r"the largest training shard holds 300 tokens, but a step of "
                                                  r"micro_batches x train_seq_len = 4 x 128 needs a shard of more than 515 "):
        config.data_shortfall(files[:1], dataclasses.replace(args, train_seq_len_schedule="128,256"))

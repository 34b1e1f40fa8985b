"""Attention masks: the CPU path (dense mask + scaled_dot_product_attention) and the CUDA path's
FlexAttention BlockMask both equal a naive reference written with explicit loops over query and
key positions, on random documents and windows."""

import pytest
import torch

import train_gpt
from conftest import effective_block_mask

BOS = train_gpt.BOS_TOKEN


def random_documents(T, n_docs, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, BOS, (T,), generator=g)
    tokens[torch.randperm(T, generator=g)[:n_docs]] = BOS
    return tokens


def naive_allowed(tokens, window_blocks, block_size, token_window=False, paired=False):
    """allowed[q][k] from the rules, one position pair at a time. token_window: FlashAttention's
    window_size=(W, 0) with causal=True, as the 2026-01-19 record calls it with W = window_blocks x
    block_size: key j is seen by query i when i - W <= j <= i (W + 1 keys with itself). paired:
    over 2T positions, token t at 2t and 2t + 1 (the record's cu_seqlens doubled)."""
    doc, docs = 0, []
    for t in tokens.tolist():
        doc += t == BOS
        docs += [doc, doc] if paired else [doc]
    T = len(docs)
    if token_window:
        W = window_blocks * block_size
        return [[q - W <= k <= q and docs[k] == docs[q] for k in range(T)] for q in range(T)]
    return [[k <= q and docs[k] == docs[q] and (q // block_size - k // block_size) < window_blocks
             for k in range(T)] for q in range(T)]


def naive_attention(q, k, v, allowed, scale):
    """q, k, v: (T, D) for one head; softmax over the allowed keys of each query."""
    out = torch.zeros_like(q, dtype=torch.float64)
    for i in range(q.shape[0]):
        keys = [j for j in range(k.shape[0]) if allowed[i][j]]
        scores = torch.tensor([scale * float(q[i].double() @ k[j].double()) for j in keys], dtype=torch.float64)
        weights = torch.softmax(scores, dim=0)
        for w, j in zip(weights, keys):
            out[i] += w * v[j].double()
    return out


CASES = [(128, 32, 1, 3, 0), (128, 32, 2, 6, 1), (192, 64, 3, 1, 2), (96, 32, 5, 9, 3), (128, 16, 3, 4, 4)]


@pytest.mark.parametrize("token_window", [False, True], ids=["blocks", "tokens"])
@pytest.mark.parametrize("T, block, window, n_docs, seed", CASES)
def test_dense_mask_equals_naive_rule(T, block, window, n_docs, seed, token_window):
    tokens = random_documents(T, n_docs, seed)
    dense = train_gpt.dense_attention_mask(tokens, torch.tensor(window), block, token_window)
    assert dense.tolist() == naive_allowed(tokens, window, block, token_window)


@pytest.mark.parametrize("T, block, window, n_docs, seed", CASES[:3])
def test_cpu_attention_path_equals_naive_attention(T, block, window, n_docs, seed):
    tokens = random_documents(T, n_docs, seed)
    g = torch.Generator().manual_seed(seed)
    H, D = 2, 8
    q, k, v = (torch.randn(1, T, H, D, generator=g) for _ in range(3))
    mask = train_gpt.dense_attention_mask(tokens, torch.tensor(window), block)
    out = train_gpt.attend(q, k, v, mask, scale=0.12)
    allowed = naive_allowed(tokens, window, block)
    for h in range(H):
        ref = naive_attention(q[0, :, h], k[0, :, h], v[0, :, h], allowed, 0.12)
        torch.testing.assert_close(out[0, :, h].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("token_window", [False, True], ids=["blocks", "tokens"])
@pytest.mark.parametrize("T, block, window, n_docs, seed", CASES)
def test_flex_block_mask_equals_naive_rule(T, block, window, n_docs, seed, token_window):
    tokens = random_documents(T, n_docs, seed)
    block_mask = train_gpt.flex_block_mask(tokens, torch.tensor(window), block, token_window)
    dense = torch.tensor(naive_allowed(tokens, window, block, token_window))
    # Equality also proves that blocks marked full are fully allowed (the kernel skips mask_mod
    # there) and that skipped blocks hold no allowed pair.
    assert torch.equal(effective_block_mask(block_mask, T), dense)


@pytest.mark.parametrize("T, block, window, n_docs, seed", CASES[:4])
def test_paired_head_masks_equal_naive_rule(T, block, window, n_docs, seed):
    tokens = random_documents(T, n_docs, seed)
    naive = torch.tensor(naive_allowed(tokens, window, block, token_window=True, paired=True))
    dense = train_gpt.dense_attention_mask(tokens, torch.tensor(window), block, token_window=True, paired=True)
    block_mask = train_gpt.flex_block_mask(tokens, torch.tensor(window), block, token_window=True, paired=True)
    assert dense.shape == (2 * T, 2 * T) and torch.equal(dense, naive)
    assert torch.equal(effective_block_mask(block_mask, 2 * T), naive)


def test_block_mask_uses_full_partial_and_skipped_blocks():
    tokens = random_documents(256, 1, 0)  # one document (plus the prefix before its BOS)
    block_mask = train_gpt.flex_block_mask(tokens, torch.tensor(3), 32)
    full, partial = block_mask.full_kv_num_blocks[0, 0], block_mask.kv_num_blocks[0, 0]
    assert int(full.sum()) > 0 and int(partial.sum()) > 0
    assert int((full + partial).max()) <= 3  # the window skips older blocks


@pytest.mark.parametrize("T, block, window, n_docs, seed, token_window",
                         [(*CASES[0], False), (*CASES[2], False), (*CASES[4], False), (*CASES[1], True)])
def test_flex_attention_forward_equals_naive_attention(T, block, window, n_docs, seed, token_window):
    # Through attend, so FlexAttention runs compiled as in training: only compiled does it visit
    # the BlockMask's block lists and skip mask_mod on full blocks (unfused, it applies mask_mod to
    # every score and ignores the lists, and mask_mod leaves the window to the lists).
    tokens = random_documents(T, n_docs, seed)
    g = torch.Generator().manual_seed(seed + 100)
    H, D = 2, 8
    q, k, v = (torch.randn(1, T, H, D, generator=g) for _ in range(3))
    block_mask = train_gpt.flex_block_mask(tokens, torch.tensor(window), block, token_window)
    out = train_gpt.attend(q, k, v, block_mask, scale=0.12)
    allowed = naive_allowed(tokens, window, block, token_window)
    for h in range(H):
        ref = naive_attention(q[0, :, h], k[0, :, h], v[0, :, h], allowed, 0.12)
        torch.testing.assert_close(out[0, :, h].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("token_windows", [True, False])  # the 2026 record's windows (the default), 2025's
def test_short_window_is_half_the_long_one(token_windows):
    args = train_gpt.Hyperparameters(attn_block_size=32, token_windows=token_windows)
    hw = train_gpt.Hardware(torch.device("cpu"), torch.float32, "sdpa", False, "torch", "gloo")
    tokens = random_documents(256, 1, 0)
    masks = train_gpt.attention_masks(tokens, torch.tensor(4), args, hw)
    assert torch.equal(masks["L"], train_gpt.dense_attention_mask(tokens, torch.tensor(4), 32, token_windows))
    assert torch.equal(masks["S"], train_gpt.dense_attention_mask(tokens, torch.tensor(2), 32, token_windows))
    assert not torch.equal(masks["L"], masks["S"])
    one = train_gpt.attention_masks(tokens, torch.tensor(1), args, hw)
    assert torch.equal(one["S"], one["L"])  # never below one block

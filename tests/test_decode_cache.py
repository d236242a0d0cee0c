"""The decode caches: a sliding window's ring (single-token steps write in place) gives exactly the keys a full
forward attends to, in either order, and hands the batching code its keys in position order."""

import torch

from archscale import GPT, ModelConfig
from archscale.models.cache import InferenceCache, WindowKVCache


def test_window_ring_keeps_the_last_keys_in_order():
    """Prefill 3 positions, then 1-token steps past three windows of 5: after each step `ordered()` is the last 4
    keys in position order, and the keys returned to attend to are that set plus the new one (any order)."""
    cache, seen = WindowKVCache(5), []

    def key(p):  # position p's key: the value p in every entry
        return torch.full((2, 1, 1, 3), float(p))

    k, _, n_old = cache.append(torch.cat([key(0), key(1), key(2)], 2), torch.cat([key(0), key(1), key(2)], 2))
    seen += [0, 1, 2]
    assert n_old == 0 and k.shape[2] == 3
    for p in range(3, 20):
        k, v, n_old = cache.append(key(p), key(p))
        seen.append(p)
        got = sorted(k[0, 0, :, 0].tolist())
        assert got == seen[-5:] and n_old == len(got) - 1, (p, got)
        assert torch.equal(k, v)
        ok, _ = cache.ordered()
        assert ok[0, 0, :, 0].tolist() == seen[-4:], p
    assert cache.next is not None  # the steps above really ran in ring mode


def test_window_ring_then_a_multi_token_step_continues_in_order():
    cache = WindowKVCache(3)
    for p in range(6):
        cache.append(torch.full((1, 1, 1, 1), float(p)), torch.full((1, 1, 1, 1), float(p)))
    k, _, n_old = cache.append(torch.tensor([6.0, 7.0]).view(1, 1, 2, 1), torch.tensor([6.0, 7.0]).view(1, 1, 2, 1))
    assert k[0, 0, :, 0].tolist() == [4.0, 5.0, 6.0, 7.0] and n_old == 2
    assert cache.ordered()[0][0, 0, :, 0].tolist() == [6.0, 7.0]


def test_cached_decoding_with_a_window_matches_the_full_forward():
    """SambaY (window 4) decoded token by token far past the window: each step's logits equal the full forward's
    at that position (1e-5)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_arch("sambay", 8, ar=8, vocab_size=61, block_size=64, sliding_window=4)).eval()
    ids = torch.randint(0, 61, (2, 24))
    with torch.no_grad():
        full = model(ids)
        cache = InferenceCache(capacity=24)
        steps = [model(ids[:, :3], cache=cache)[:, -1]]
        steps += [model(ids[:, t:t + 1], cache=cache)[:, -1] for t in range(3, 24)]
    for t, got in enumerate(steps, start=2):
        torch.testing.assert_close(got, full[:, t], atol=1e-5, rtol=0)

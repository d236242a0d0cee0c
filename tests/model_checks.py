"""Per-architecture checks shared by tests/test_architectures.py and the negative control in
tests/test_registry.py (which runs them on a model whose mixers output zeros and expects them to fail)."""

import torch


def check_information_flows(model, vocab=97, T=23, t=11):
    """Change token t: logits before t must not move (causality), logits at every position after t must
    (information crosses positions through the mixers; position t itself is excluded, since its own embedding
    changed). Exact comparisons: a position that cannot see token t computes bit-identical logits, while a
    recurrent model's influence may decay to ~1e-8 after a few positions at its initial dt."""
    idx = torch.randint(0, vocab, (2, T))
    other = idx.clone()
    other[:, t] = (other[:, t] + 1) % vocab
    with torch.no_grad():
        a, b = model(idx), model(other)
    assert torch.equal(a[:, :t], b[:, :t]), "a past position saw a future token"
    moved = (a[:, t + 1:] - b[:, t + 1:]).abs().amax(dim=(0, 2))
    assert bool((moved > 0).all()), f"positions after the change did not see it: {moved.tolist()}"


def check_every_parameter_learns(model, vocab=97, T=24):
    """One backward: every parameter gets a gradient that is not zero (no dead branch, no dead mixer)."""
    model.zero_grad(set_to_none=True)
    idx = torch.randint(0, vocab, (2, T + 1))
    logits = model(idx[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().max() > 0)]
    assert not dead, f"parameters without gradient: {dead}"

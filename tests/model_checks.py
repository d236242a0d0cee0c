"""Per-architecture checks shared by tests/test_architectures.py and the negative control in
tests/test_registry.py (which runs them on a model whose mixers output zeros and expects them to fail). They are
the product's own contract checks (`archscale layout SPEC --check`), so the tests and the command agree."""

from archscale.layout_check import check_every_parameter_learns, check_information_flows  # noqa: F401

"""OutputFactory: the tower's output object built directly equals the one its own constructor builds."""

import dataclasses

import torch

from vgraph_compile.hf.outputs import OutputFactory

from tests.hf.conftest import transformers  # noqa: F401  (skips without transformers)


def _classes():
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    @dataclasses.dataclass
    class PlainOutput:
        last_hidden_state: torch.Tensor
        pooler_output: torch.Tensor | None = None

    return BaseModelOutputWithPooling, PlainOutput


def test_a_model_output_is_built_directly_and_equals_its_constructors():
    """After the first call (built normally, checked), a ModelOutput is built without its __init__: same class,
    same items in order (None fields left out), same attributes, read by name, index and to_tuple."""
    model_output, _ = _classes()
    factory = OutputFactory(model_output)
    hidden, pooled = torch.randn(4, 3), torch.randn(1, 3)
    first = factory({"last_hidden_state": hidden, "pooler_output": pooled})
    assert factory._names is not None  # the direct build matched: used from now on
    calls = []
    original = model_output.__post_init__
    model_output.__post_init__ = lambda self: calls.append(self) or original(self)
    try:
        direct = factory({"last_hidden_state": hidden, "pooler_output": None})
    finally:
        model_output.__post_init__ = original
    assert calls == [] and type(direct) is model_output and type(first) is model_output
    expected = model_output(last_hidden_state=hidden, pooler_output=None)
    assert list(direct.keys()) == list(expected.keys()) == ["last_hidden_state"]
    assert direct.last_hidden_state is hidden and direct["last_hidden_state"] is hidden and direct[0] is hidden
    assert direct.pooler_output is None and direct.hidden_states is None and len(direct.to_tuple()) == 1
    assert vars(direct).keys() == vars(expected).keys()


def test_a_class_that_is_not_a_model_output_is_built_by_its_constructor():
    """A plain dataclass is not an ordered dict: the factory calls its constructor every time."""
    _, plain = _classes()
    factory = OutputFactory(plain)
    hidden = torch.randn(2, 3)
    out = factory({"last_hidden_state": hidden})
    assert factory._names is None and type(out) is plain and out.last_hidden_state is hidden
    assert factory({"last_hidden_state": hidden}).pooler_output is None

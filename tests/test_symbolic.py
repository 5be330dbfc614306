"""Sizes as sympy expressions of the trace's symbols: substituted, evaluated, and refused when a symbol has no value."""

import pytest
import sympy
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from vgraph_compile.symbolic import evaluate, substitute, traced_values

TOKENS, IMAGES = sympy.symbols("s0 s1", integer=True, positive=True)


def test_substitute_replaces_the_given_symbols_and_keeps_the_others():
    assert substitute(TOKENS + 2 * IMAGES, {IMAGES: 3}) == TOKENS + 6
    assert substitute(7, {TOKENS: 1}) == 7  # a plain int is an expression too


def test_evaluate_gives_an_int_and_names_what_has_no_value():
    assert evaluate(TOKENS + IMAGES, {TOKENS: 64, IMAGES: 4}, "the token rows") == 68
    assert isinstance(evaluate(TOKENS + IMAGES, {TOKENS: 64, IMAGES: 4}, "the token rows"), int)
    with pytest.raises(ValueError, match=r"the token rows is s0 \+ s1: \['s1'\] have no value"):
        evaluate(TOKENS + IMAGES, {TOKENS: 64}, "the token rows")


def test_traced_values_are_the_values_of_the_traced_call():
    shape_env = ShapeEnv()
    unbacked = shape_env.create_unbacked_symint()  # data-dependent: no traced value
    size = shape_env.create_symbol(12, source=ConstantSource("tokens"))
    assert traced_values(shape_env)[size] == 12
    assert unbacked.node.expr not in traced_values(shape_env)

"""Sizes as sympy expressions of the trace's symbols: substituted, evaluated, refused when a symbol has no value,
and (``canonical``) put in the trace's canonical symbols with what the ShapeEnv knows used: its divisibility facts,
a multiple recorded as an equality guard, and a floor division its guards fix; on a real ShapeEnv whose facts come
from guards as a ``view`` records them."""

import pytest
import sympy
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._sympy.functions import FloorDiv, Mod

from vgraph_compile.symbolic import canonical, evaluate, substitute, traced_values

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


def _tokens_with(guard):
    """A ShapeEnv with one token symbol ``T`` (traced at 48) and the guard ``guard(T)`` recorded."""
    env = ShapeEnv()
    symbol = env.create_symbol(48, source=ConstantSource("T"), dynamic_dim=DimDynamic.DYNAMIC)
    tokens = env.create_symintnode(symbol, hint=48)
    assert bool(guard(tokens))
    return env, symbol


def _tokens_a_multiple_of(divisor: int):
    """A ShapeEnv with one token symbol ``T`` (traced at 48) and the guard ``T % divisor == 0``."""
    return _tokens_with(lambda tokens: tokens % divisor == 0)


def test_divisibility_facts_simplify_floor_divisions_and_guards():
    """``T // (T // 4)`` (a window permutation's ``view(T // 4, -1, d)``) is 4 once ``T % 4 == 0`` is known, so
    a packed row count ``12 * that`` is a constant, and a guard over it holds; ``T`` itself is left as it is."""
    env, tokens = _tokens_a_multiple_of(4)
    windows = FloorDiv(tokens, FloorDiv(tokens, 4))
    assert env.replace(windows) == windows  # the replacements alone keep it
    assert canonical(env, 12 * windows) == 48
    assert canonical(env, Mod(tokens + 4, 4)) == 0
    assert canonical(env, sympy.Eq(windows, 4)) == sympy.true
    assert canonical(env, tokens) == tokens
    assert canonical(env, FloorDiv(tokens, 4)) == FloorDiv(tokens, 4)


def test_no_fact_no_rewrite():
    """``T // 8`` under ``T % 4 == 0`` proves nothing: it is kept."""
    env, tokens = _tokens_a_multiple_of(4)
    assert canonical(env, FloorDiv(tokens, 8)) == FloorDiv(tokens, 8)
    assert canonical(env, FloorDiv(tokens, FloorDiv(tokens, 8))) == FloorDiv(tokens, FloorDiv(tokens, 8))


def test_a_multiple_recorded_as_an_equality_guard_is_a_divisibility_fact():
    """``x.view(T // 4, 4, d)`` records ``16 T == 64 (T // 4)``, not ``T % 4 == 0`` (the ShapeEnv's divisibility set
    stays empty); every remainder of ``T`` by 4 but 0 breaks it, so ``T`` is a multiple of 4 all the same."""
    env, tokens = _tokens_with(lambda tokens: 16 * tokens == 64 * (tokens // 4))
    assert not env.divisible
    assert canonical(env, 12 * FloorDiv(tokens, FloorDiv(tokens, 4))) == 48
    assert canonical(env, Mod(tokens + 4, 4)) == 0
    assert canonical(env, FloorDiv(tokens, 8)) == FloorDiv(tokens, 8)


def test_a_floor_division_the_guards_fix_is_its_traced_value():
    """The guard ``T // (T // 4) == 4`` (a view whose merge unit dynamo matched to the 4 written) proves that
    division 4 without proving ``T % 4 == 0``: the division becomes 4, ``T % 4`` and ``T // (T // 8)`` are kept."""
    env, tokens = _tokens_with(lambda tokens: tokens // (tokens // 4) == 4)
    assert canonical(env, 12 * FloorDiv(tokens, FloorDiv(tokens, 4))) == 48
    assert canonical(env, Mod(tokens, 4)) == Mod(tokens, 4)
    assert canonical(env, FloorDiv(tokens, FloorDiv(tokens, 8))) == FloorDiv(tokens, FloorDiv(tokens, 8))

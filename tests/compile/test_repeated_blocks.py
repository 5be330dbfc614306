"""``repeated_blocks``: identical blocks of a module list become calls of one shared subgraph; blocks that differ
stay apart; the compiled graph equals eager on any shape; a second process loads it from the saved artifact."""

import copy
import json

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline
from hypothesis import given
from hypothesis import strategies as st

import vgraph_compile
from tests.helpers import counter_changes, trace
from vgraph_compile.analyze import analyze
from vgraph_compile.compile import repeated_blocks
from vgraph_compile.rewrite.kernel_choice import choose_kernels
from vgraph_compile.config import VGraphConfig
from vgraph_compile.counters import counters
from vgraph_compile.fx_utils import callable_name, example_value
from vgraph_compile.sample_models import explain_factories
from vgraph_compile.sample_models.packed_vit import Block, PackedViT, WindowedViT, pack_images
from vgraph_compile.rewrite import COMPILE_REWRITES, REWRITES, rewrite
from vgraph_compile.spec import user_name

pytestmark = pytest.mark.heavy  # few, slow tests: a worker takes this module first (conftest.py)

OPTIONS = {"token_budgets": (16, 64), "max_segments": 4, "attention_backend": "sdpa"}


def _rewritten(model, inputs, **options):
    """The graph inductor would compile (the trace after every rewrite), and its context."""
    gm, ctx = trace(model, *inputs, config=VGraphConfig(**{**OPTIONS, **options}))
    analyze(gm, ctx)
    ctx.kernels = choose_kernels(gm, ctx)
    return rewrite(copy.deepcopy(gm), ctx, REWRITES + COMPILE_REWRITES), ctx


def _argument(node, spec) -> str:
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    value = example_value(node)
    if node.op == "placeholder" and isinstance(value, torch.SymInt):
        return spec.describe(value.node.expr)
    if node.op == "get_attr":
        return str(node.target)
    return user_name(node.name) if node.op == "placeholder" else node.name


def _calls(gm, spec) -> str:
    """One line per call of ``gm``: name = callee(arguments), graph inputs in the user's names; a block's run of
    parameters as ``self.blocks.0.[norm1.weight ...]``."""

    def grouped(texts: list[str]) -> list[str]:
        out, run = [], []
        for text in [*texts, None]:
            if text is not None and text.startswith("self.blocks."):
                run.append(text)
                continue
            if run:
                prefix = ".".join(run[0].split(".")[:3])
                out.append(f"{prefix}.[{' '.join(name[len(prefix) + 1 :] for name in run)}]")
                run = []
            if text is not None:
                out.append(text)
        return out

    lines = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            arguments = grouped([_argument(argument, spec) for argument in node.args])
            lines.append(f"{node.name} = {callable_name(node)}({', '.join(arguments)})")
    return "\n".join(lines)


def _shared(gm) -> list[str]:
    """The identifier of each ``invoke_subgraph`` call, in graph order."""
    return [node.args[1] for node in gm.graph.nodes if node.target is torch.ops.higher_order.invoke_subgraph]


def test_two_blocks_before_and_after():
    """The two blocks' 16 nodes each become one call of ``repeated_block_0`` (identifier ``blocks_0``): the size of
    the token dim first, then the hidden state, the block's own parameters and the offsets; the embedding, final
    norm and merger stay inline. The shared subgraph holds one block's nodes."""
    torch.manual_seed(0)
    gm, ctx = _rewritten(PackedViT(patch_dim=12, dim=16, depth=2, heads=2, out_dim=8).eval(), pack_images([5, 7], 12))
    assert_expected_inline(
        _calls(gm, ctx.spec),
        """\
x = linear(patches, self.embed.weight, self.embed.bias)
layer_norm = layer_norm(x, (16,), self.blocks.0.[norm1.weight norm1.bias], 1e-05)
linear_1 = linear(layer_norm, self.blocks.0.[qkv.weight qkv.bias])
view = view(linear_1, patches.shape[0], 3, 2, -1)
unbind = unbind(view, 1)
q = getitem(unbind, 0)
k = getitem(unbind, 1)
v = getitem(unbind, 2)
attended = varlen_attention(q, k, v, cu_seqlens, max_seqlen)
reshape = reshape(attended, patches.shape[0], -1)
linear_2 = linear(reshape, self.blocks.0.[proj.weight proj.bias])
x_1 = add(x, linear_2)
layer_norm_1 = layer_norm(x_1, (16,), self.blocks.0.[norm2.weight norm2.bias], 1e-05)
linear_3 = linear(layer_norm_1, self.blocks.0.[fc1.weight fc1.bias])
gelu = gelu(linear_3)
linear_4 = linear(gelu, self.blocks.0.[fc2.weight fc2.bias])
x_2 = add(x_1, linear_4)
layer_norm_2 = layer_norm(x_2, (16,), self.blocks.1.[norm1.weight norm1.bias], 1e-05)
linear_5 = linear(layer_norm_2, self.blocks.1.[qkv.weight qkv.bias])
view_1 = view(linear_5, patches.shape[0], 3, 2, -1)
unbind_1 = unbind(view_1, 1)
q_1 = getitem(unbind_1, 0)
k_1 = getitem(unbind_1, 1)
v_1 = getitem(unbind_1, 2)
attended_1 = varlen_attention(q_1, k_1, v_1, cu_seqlens, max_seqlen)
reshape_1 = reshape(attended_1, patches.shape[0], -1)
linear_6 = linear(reshape_1, self.blocks.1.[proj.weight proj.bias])
x_3 = add(x_2, linear_6)
layer_norm_3 = layer_norm(x_3, (16,), self.blocks.1.[norm2.weight norm2.bias], 1e-05)
linear_7 = linear(layer_norm_3, self.blocks.1.[fc1.weight fc1.bias])
gelu_1 = gelu(linear_7)
linear_8 = linear(gelu_1, self.blocks.1.[fc2.weight fc2.bias])
x_4 = add(x_3, linear_8)
x_5 = layer_norm(x_4, (16,), self.norm.weight, self.norm.bias, 1e-05)
reshape_2 = reshape(x_5, -1, 16)
linear_9 = linear(reshape_2, self.merger.weight, self.merger.bias)""",
    )
    shared = repeated_blocks.run(gm)
    assert_expected_inline(
        _calls(shared, ctx.spec),
        """\
x = linear(patches, self.embed.weight, self.embed.bias)
invoke_subgraph = invoke_subgraph(repeated_block_0, 'blocks_0', cu_seqlens.shape[0], x, self.blocks.0.[norm1.weight norm1.bias qkv.weight qkv.bias], patches.shape[0], cu_seqlens, max_seqlen, self.blocks.0.[proj.weight proj.bias norm2.weight norm2.bias fc1.weight fc1.bias fc2.weight fc2.bias])
getitem = getitem(invoke_subgraph, 0)
invoke_subgraph_1 = invoke_subgraph(repeated_block_0, 'blocks_0', cu_seqlens.shape[0], getitem, self.blocks.1.[norm1.weight norm1.bias qkv.weight qkv.bias], patches.shape[0], cu_seqlens, max_seqlen, self.blocks.1.[proj.weight proj.bias norm2.weight norm2.bias fc1.weight fc1.bias fc2.weight fc2.bias])
getitem_1 = getitem(invoke_subgraph_1, 0)
x_5 = layer_norm(getitem_1, (16,), self.norm.weight, self.norm.bias, 1e-05)
reshape_2 = reshape(x_5, -1, 16)
linear_9 = linear(reshape_2, self.merger.weight, self.merger.bias)""",
    )
    subgraph = shared.get_submodule("repeated_block_0")
    assert_expected_inline(
        " ".join(callable_name(node) for node in subgraph.graph.nodes if node.op in ("call_function", "call_method")),
        """layer_norm linear view unbind getitem getitem getitem varlen_attention reshape linear add layer_norm linear gelu linear add""",
    )


class MixedBlocks(PackedViT):
    """Four blocks: 0 and 2 alike; 1 with a narrower MLP, 3 with more heads (same parameter shapes, another view)."""

    def __init__(self) -> None:
        super().__init__(patch_dim=12, dim=16, depth=4, heads=2, out_dim=8)
        self.blocks[1] = Block(16, 2, mlp_ratio=2)
        self.blocks[3] = Block(16, 4)


def _operands(gm, spec) -> list[set[str]]:
    """The graph inputs each ``invoke_subgraph`` call reads, in the user's names, parameters left out (the token
    count reads ``window_index.shape[0]``: tokens / 4)."""
    calls = [node for node in gm.graph.nodes if node.target is torch.ops.higher_order.invoke_subgraph]
    names = [{_argument(argument, spec) for argument in call.args[2:] if argument.op == "placeholder"} for call in calls]
    return [{name for name in read if not name.startswith("self.")} for read in names]


def test_blocks_that_differ_are_not_merged():
    """Blocks 1 (MLP width 32) and 3 (4 heads: another view of the qkv output) match no other block and stay
    inline; 0 and 2 share one subgraph."""
    torch.manual_seed(0)
    gm, _ = _rewritten(MixedBlocks().eval(), pack_images([5, 7], 12))
    with counters.expect(blocks_compiled_once=2):
        shared = repeated_blocks.run(gm)
    assert _shared(shared) == ["blocks_0", "blocks_0"]
    inline = [node for node in shared.graph.nodes if callable_name(node) == "varlen_attention"]
    assert [node.meta["nn_module_stack"][next(iter(node.meta["nn_module_stack"]))][0] for node in inline] == [
        "L['self'].blocks.1",
        "L['self'].blocks.3",
    ]


WINDOWED = {"geometry": explain_factories.QWEN25_GEOMETRY, "max_items": 3, "max_frames": 6, "max_segments": None}


def _windowed_model(seed: int = 0) -> WindowedViT:
    torch.manual_seed(seed)
    return WindowedViT(patch_dim=12, dim=16, depth=4, heads=2, out_dim=8, full_attention_blocks=(1, 3)).eval()


def test_window_and_full_attention_blocks_are_two_classes():
    """Window blocks (0, 2) read the window offsets, full-attention blocks (1, 3) the frame offsets, of other
    lengths: two subgraphs, each shared by its two blocks."""
    inputs = explain_factories.windowed_inputs(explain_factories.QWEN25_GEOMETRY, [(1, 8, 12), (1, 4, 4)], 12)
    gm, ctx = _rewritten(_windowed_model(), inputs, token_budgets=(64, 256), **WINDOWED)
    shared = repeated_blocks.run(gm)
    assert _shared(shared) == ["blocks_0", "blocks_1", "blocks_0", "blocks_1"]
    window = {"cu_window_seqlens", "cu_window_seqlens.shape[0]", "max_window_seqlen", "window_index.shape[0]"}
    full = {"cu_seqlens", "cu_seqlens.shape[0]", "max_seqlen", "window_index.shape[0]"}
    assert _operands(shared, ctx.spec) == [window, full, window, full]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """The four-block windowed encoder compiled with inductor into a fresh artifact directory. First call: one
    trace, 4 sites (their kernel set in the eager and compiled copies: 8 rewrites), one compile with the 4 blocks
    in two shared subgraphs, saved with the decorator's and the backend's plans; 2 buckets, 1 replay."""
    directory = tmp_path_factory.mktemp("artifacts")
    model = _windowed_model()
    compiled = vgraph_compile.encoder(
        model, token_budgets=(64, 256), attention_backend="sdpa", artifact_dir=str(directory), **WINDOWED
    )
    inputs = explain_factories.windowed_inputs(explain_factories.QWEN25_GEOMETRY, [(1, 8, 12), (1, 4, 4)], 12)
    expected = dict(traces=1, sites_found=4, nodes_rewritten=8, compiles=1, blocks_compiled_once=4)
    with torch.no_grad(), counters.expect(**expected, artifacts_saved=1, plans_saved=2, buckets_built=2, replays=1):
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
    return model, compiled, directory


grids = st.lists(
    st.tuples(st.sampled_from([1, 2]), st.integers(1, 6).map(lambda a: 2 * a), st.integers(1, 6).map(lambda b: 2 * b)),
    min_size=1,
    max_size=3,
).filter(lambda grid: sum(t * h * w for t, h, w in grid) <= 256 and sum(t for t, _, _ in grid) <= 6)


@given(grid=grids)
def test_compiled_blocks_equal_eager(windowed, grid):
    """The shared-subgraph compile, called per block at each bucket's sizes: every real row equals eager within
    fp32 round-off and is finite, each call a replay."""
    model, compiled, _ = windowed
    inputs = explain_factories.windowed_inputs(explain_factories.QWEN25_GEOMETRY, grid, 12)
    with torch.no_grad(), counter_changes() as changes:
        out = compiled(*inputs)
    assert out.isfinite().all()
    torch.testing.assert_close(out, model(*inputs), rtol=1e-5, atol=1e-5)
    assert (changes["replays"], changes["eager_fallbacks"]) == (1, 0), changes


SERVE = """
import json, sys, torch
from tests.compile.test_repeated_blocks import WINDOWED, _windowed_model
import vgraph_compile
from vgraph_compile.counters import counters
from vgraph_compile.sample_models import explain_factories
model = _windowed_model(seed=1)
compiled = vgraph_compile.encoder(model, token_budgets=(64, 256), attention_backend="sdpa", artifact_dir=sys.argv[1],
                                  **WINDOWED)
errors = []
with torch.no_grad():
    for grid in json.loads(sys.argv[2]):
        inputs = explain_factories.windowed_inputs(explain_factories.QWEN25_GEOMETRY, grid, 12)
        out, ref = compiled(*inputs), model(*inputs)
        errors.append(bool(out.isfinite().all()) and ((out - ref).abs().max() / ref.abs().max()).item())
frames = torch._dynamo.utils.counters["frames"]["total"]
print(json.dumps({"counters": counters.snapshot(), "frames": frames, "errors": errors}))
"""


def test_a_second_process_loads_the_shared_block_compile(windowed, new_process):
    """A new process with other weights serves from the saved plan and compiled artifact: no dynamo frame, no
    trace, no compile (so no block pass either), its own weights read, every call replayed and eager-equal."""
    _, _, directory = windowed
    calls = [[(1, 8, 12), (1, 4, 4)], [(2, 4, 8)], [(1, 12, 12), (1, 2, 2)]]
    child = new_process(SERVE, str(directory), json.dumps(calls))
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    moved = {name: value for name, value in report["counters"].items() if value}
    assert moved == {"plans_loaded": 1, "artifacts_loaded": 1, "buckets_built": 2, "replays": 3}
    assert report["frames"] == 0
    assert all(error is not False and error <= 1e-5 for error in report["errors"]), report["errors"]


class ScaledInPlace(Block):
    """A block that scales a copy of its output in place (``mul_``)."""

    def forward(self, x, cu_seqlens, max_seqlen):
        out = super().forward(x, cu_seqlens, max_seqlen) * 2
        out.mul_(0.5)
        return out


def test_blocks_writing_in_place_stay_inline(caplog):
    """Two identical blocks that write in place are not shared: a subgraph may not mutate (the log says which
    node)."""
    torch.manual_seed(0)
    model = PackedViT(patch_dim=12, dim=16, depth=2, heads=2, out_dim=8).eval()
    model.blocks = nn.ModuleList(ScaledInPlace(16, 2) for _ in range(2))
    gm, _ = _rewritten(model, pack_images([5, 7], 12), max_segments=4)
    with caplog.at_level("INFO", logger=repeated_blocks.__name__), counters.expect():
        shared = repeated_blocks.run(gm)
    assert _shared(shared) == []
    assert [record.getMessage().split(": ")[-1] for record in caplog.records] == [
        "mul_ writes in place",
        "mul__1 writes in place",
    ]

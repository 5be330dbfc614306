"""On a CUDA GPU, every attention kernel that runs there: equality against a float64 reference at the towers' head
dims on ragged and equal-length segments, and isolation of NaN/Inf per segment (the Triton confinement against its
torch reference: ``tests/kernels/test_confine_triton.py``). Run with ``pytest -m gpu``."""

import pytest
import torch
from hypothesis import given

from tests.kernels.test_segments import check_isolation, poisoned_calls
from tests.helpers import run_backend, segment_reference
from vgraph_compile.rewrite import kernel_choice
from vgraph_compile.kernels import registry
from vgraph_compile.kernels.segments import cu_seqlens

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BF16_TOLERANCE = dict(rtol=2e-2, atol=2e-2)
KERNELS = [(name, dtype) for name in registry.BACKENDS for dtype in (torch.bfloat16, torch.float32)]


def _require(name, dtype):
    reason = registry.BACKENDS[name].unavailable(CUDA, dtype)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("name", list(registry.BACKENDS))
@pytest.mark.parametrize("lengths", [[1, 0, 300, 129, 2000, 7], [512] * 4], ids=["ragged", "equal"])
@pytest.mark.parametrize(
    "dtype, head_dim",
    [(torch.bfloat16, 64), (torch.bfloat16, 72), (torch.bfloat16, 80), (torch.float32, 80)],
)
def test_kernel_matches_float64_reference(name, lengths, dtype, head_dim):
    """Ragged segments (1, 0, 300, 129, 2000 and 7 rows) or four of 512, then padding rows (NaN) up to 4096: real
    rows within bf16 (fp32) rounding of the reference, padding rows exactly zero."""
    _require(name, dtype)
    generator = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(4096, 4, head_dim, generator=generator).to(CUDA, dtype) for _ in range(3))
    cu = cu_seqlens(lengths, CUDA)
    end = sum(lengths)
    for t in (q, k, v):
        t[end:] = float("nan")
    out = run_backend(name, q, k, v, cu, max(lengths))
    reference = segment_reference(*(t[:end].cpu() for t in (q, k, v)), cu.cpu())
    tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[:end].double().cpu(), reference, **tolerance)
    assert out[end:].eq(0).all()


@pytest.mark.parametrize("name, dtype", KERNELS)
@given(call=poisoned_calls())
def test_nonfinite_values_stay_in_their_segment_on_cuda(name, dtype, call):
    """As on the CPU; every call padded to 4 segments and 600 rows, so a compiling kernel compiles once; head_dim 16,
    the narrowest FlexAttention compiles on CUDA."""
    _require(name, dtype)
    lengths, padding, *poison = call
    lengths = lengths + [0] * (4 - len(lengths))
    tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    check_isolation(name, (lengths, 600 - sum(lengths), *poison), dtype, "cuda", tolerance, head_dim=16)


@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("lengths", [[1, 0, 300, 129, 2000, 7], [512] * 4], ids=["ragged", "equal"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_confined_kernel_keeps_other_segments_bit_identical(head_dim, lengths, value):
    """A confined kernel (``sdpa``) at a tower's head dim, 16 heads, bf16, NaN padding rows up to 4096: a NaN/Inf
    planted in one segment's k and another in its v leave every other segment's rows bit-identical to the clean
    run; the poisoned segment's two heads are NaN, its other heads equal the clean run; padding rows are zero."""
    generator = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(4096, 16, head_dim, generator=generator).to(CUDA, torch.bfloat16) for _ in range(3))
    cu = cu_seqlens(lengths, CUDA)
    end = sum(lengths)
    for t in (q, k, v):
        t[end:] = float("nan")
    clean = run_backend("sdpa", q, k, v, cu, max(lengths))
    segment = max(range(len(lengths)), key=lambda index: lengths[index])
    start, stop = int(cu[segment]), int(cu[segment + 1])
    k, v = k.clone(), v.clone()
    k[start + 3, 5, 7] = value
    v[stop - 1, 11, 0] = value
    dirty = run_backend("sdpa", q, k, v, cu, max(lengths))
    others = torch.ones(4096, dtype=torch.bool, device=CUDA)
    others[start:stop] = False
    assert torch.equal(dirty[others], clean[others])
    assert dirty[start:stop, [5, 11]].isnan().all()
    kept = [head for head in range(16) if head not in (5, 11)]
    assert torch.equal(dirty[start:stop, kept], clean[start:stop, kept])
    assert dirty[end:].eq(0).all() and clean[end:].eq(0).all()


@pytest.mark.parametrize("head_dim", [72, 80])
def test_auto_times_every_candidate_as_a_graph_replay(head_dim):
    """Each kernel ``auto`` would time is captured and replayed on a full-attention group's shape (one image in a
    bucket of 8 segment slots), the dense SDPA kernels that ship with torch among them."""
    shape = kernel_choice.GroupShape(
        rows=2304, segment=2304, capacity=8, heads=4, head_dim=head_dim, dtype=torch.bfloat16
    )
    names = kernel_choice._candidates(CUDA, torch.bfloat16)
    assert {"torch_varlen", "dense_cudnn", "dense_flash", "dense_efficient"} <= set(names)
    for name in names:
        assert 0 < kernel_choice._time_ms(name, shape, CUDA) < 100, name


@pytest.mark.parametrize("name", [name for name, backend in registry.BACKENDS.items() if not backend.qkv_offsets])
@pytest.mark.parametrize("lengths, padding", [([300, 129, 7], 76), ([512], 0)])
def test_opcheck_on_cuda(name, lengths, padding):
    """Every kernel that runs on this GPU returns what the op's fake kernel promises (``torch.library.opcheck``:
    shape, dtype, contiguous strides), at head_dim 72 (padded by the op for the kernels that need it)."""
    from torch.library import opcheck

    from vgraph_compile.kernels.ops import VARLEN_ATTENTION

    _require(name, torch.bfloat16)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    rows = sum(lengths) + padding
    q, k, v = (
        torch.randn(rows, 16, 72, device=CUDA, dtype=torch.bfloat16, generator=generator) for _ in range(3)
    )
    opcheck(VARLEN_ATTENTION.default, (q, k, v, cu_seqlens(lengths, CUDA), max(lengths), None, name))


def test_fa4_kernels_compiled_by_one_process_are_loaded_by_the_next(tmp_path):
    """FA4's JIT-compiled kernels land beside inductor's cache; a second process (same cache) writes none again and
    computes the same output, so a warm start pays no CuTe-DSL compile."""
    import os
    import subprocess
    import sys

    _require("fa4", torch.bfloat16)
    script = (
        "import torch, sys\n"
        "from vgraph_compile.kernels.ops import varlen_attention\n"
        "from vgraph_compile.kernels.segments import cu_seqlens\n"
        "g = torch.Generator(device='cuda').manual_seed(0)\n"
        "q, k, v = (torch.randn(700, 16, 72, device='cuda', dtype=torch.bfloat16, generator=g) for _ in range(3))\n"
        "out = varlen_attention(q, k, v, cu_seqlens([300, 400], 'cuda'), 400, backend='fa4')\n"
        "torch.save(out.cpu(), sys.argv[1])\n"
    )
    inherited = {name: value for name, value in os.environ.items() if not name.startswith("FLASH_ATTENTION_CUTE_DSL")}
    env = {**inherited, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # not this process's FA4 cache
    cached = tmp_path / "inductor" / "flash_attention_cute_dsl"

    def files():
        return {path: path.stat().st_mtime_ns for path in cached.rglob("*") if path.is_file()}

    subprocess.run([sys.executable, "-c", script, str(tmp_path / "first.pt")], env=env, check=True, timeout=600)
    written = files()
    assert written, "the first process saved no compiled kernel"
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "second.pt")], env=env, check=True, timeout=600)
    assert files() == written  # nothing compiled and written again
    assert torch.equal(torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt"))


def test_dense_kernels_leave_the_processes_sdpa_choice_as_torch_makes_it():
    """A process that ran a dense kernel (``sdpa_kernel`` with a priority, ``kernels/dense.py``) chooses the SDPA
    backend for its own attention as a process that never ran one does (the So400m tiles' shape; cuDNN on an H200
    with torch's cuDNN preference)."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "q = torch.randn(13, 16, 729, 72, device='cuda', dtype=torch.bfloat16)\n"
        "if sys.argv[1] == 'dense':\n"
        "    from vgraph_compile.kernels import dense\n"
        "    from vgraph_compile.kernels.segments import cu_seqlens\n"
        "    x = torch.randn(64, 2, 72, device='cuda', dtype=torch.bfloat16)\n"
        "    dense.cudnn(x, x, x, cu_seqlens([64], 'cuda'), 64, None)\n"
        "print(int(torch._fused_sdp_choice(q, q, q)))\n"
    )
    choices = [
        subprocess.run([sys.executable, "-c", script, first], capture_output=True, text=True, check=True, timeout=300)
        .stdout.split()[-1]
        for first in ("nothing", "dense")
    ]
    assert choices[1] == choices[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 4096, 9216])
def test_linear_gelu_epilogue_matches_the_unfused_layer(dtype, rows):
    """``vgraph::linear_gelu_tanh`` on CUDA (cuBLASLt's GELU epilogue) in the half precisions the rewrite uses it
    in, at Qwen3-VL's MLP widths (1152 -> 4304): no farther from the float64 layer than the unfused layer is, or
    than one rounding of the largest output; its fake kernel holds
    (``torch.library.opcheck``)."""
    from torch.library import opcheck

    from vgraph_compile.kernels.gemm_epilogues import LINEAR_GELU_TANH

    generator = torch.Generator().manual_seed(rows)
    x, weight, bias = (
        (torch.randn(*shape, generator=generator) * scale).to(CUDA, dtype)
        for shape, scale in (((rows, 1152), 1.0), ((4304, 1152), 1152**-0.5), ((4304,), 1.0))
    )
    exact = torch.nn.functional.gelu(
        torch.nn.functional.linear(x.double(), weight.double(), bias.double()), approximate="tanh"
    )
    unfused = torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias), approximate="tanh")
    fused = LINEAR_GELU_TANH(x, weight, bias)
    torch.testing.assert_close(fused.double(), exact, **BF16_TOLERANCE)
    fused_error, unfused_error = ((out.double() - exact).abs().max().item() for out in (fused, unfused))
    assert fused_error <= max(unfused_error, torch.finfo(dtype).eps * exact.abs().max().item())
    opcheck(LINEAR_GELU_TANH.default, (x[:64], weight, bias))

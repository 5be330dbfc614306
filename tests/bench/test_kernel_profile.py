"""Kernel kinds of the profile breakdown, from kernel names as the CUDA profiler reports them."""

from vgraph_compile.bench.kernel_profile import kind_of


def test_kinds_from_kernel_names():
    """NCCL's all-to-all is grouped send/recv; NCCL kernels are told apart before any other kind (an NCCL kernel
    name never counts as attention or gemm)."""
    names = {
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "all-to-all (nccl)",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all-gather (nccl)",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "other collectives (nccl)",
        "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>(Flash_fwd_params)": "attention",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT": "gemm",
        "triton_poi_fused_add_mul_0": "triton (inductor fused)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
    }
    assert {name: kind_of(name) for name in names} == names

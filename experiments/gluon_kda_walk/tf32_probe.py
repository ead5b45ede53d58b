"""Does an fp32 (tf32) register A operand compile against an fp32 shared B operand, plain and transposed view?"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, warpgroup_mma
from gluon_compile import compile_sm90, resources


@gluon.jit
def tf32_probe_kernel(b_desc, s_ptr, out_ptr, TRANS_B: gl.constexpr, VB: gl.constexpr, K: gl.constexpr,
                      N: gl.constexpr, num_warps: gl.constexpr):
    b_s = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(b_desc, [0, 0], bar, b_s)
    mbarrier.wait(bar, 0)
    C_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N, 8])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, K, 8])
    rv = gl.arange(0, VB, gl.SliceLayout(1, S_L))
    ck = gl.arange(0, K, gl.SliceLayout(0, S_L))
    S = gl.load(s_ptr + rv[:, None] * K + ck[None, :])
    S_op = gl.convert_layout(S, gl.DotOperandLayout(operand_index=0, parent=C_L, k_width=1))
    if TRANS_B:
        b = b_s.permute((1, 0))  # b tile stored [N, K]
    else:
        b = b_s  # b tile stored [K, N]
    acc = warpgroup_mma(S_op, b, gl.zeros([VB, N], gl.float32, C_L), use_acc=False)  # precision="tf32" fails in 3.6.0 (constexpr not unwrapped); default input precision is tf32
    r = gl.arange(0, VB, gl.SliceLayout(1, C_L))
    cn = gl.arange(0, N, gl.SliceLayout(0, C_L))
    gl.store(out_ptr + r[:, None] * N + cn[None, :], acc)


for trans in (False, True):
    shape = [64, 128] if trans else [128, 64]
    B = torch.zeros(*shape)
    d = TensorDescriptor.from_tensor(B, shape, gl.NVMMASharedLayout.get_default_for(shape, gl.float32))
    try:
        k = compile_sm90(tf32_probe_kernel, (d, torch.zeros(64, 128), torch.zeros(64, 64)),
                         dict(TRANS_B=trans, VB=64, K=128, N=64, num_warps=4))
        r = resources(k)
        print(f"tf32 TRANS_B={trans}: OK regs {r['registers']} spills {r['spill_stores']} wgmma {r['wgmma_shapes']}")
    except Exception as e:  # noqa: BLE001
        print(f"tf32 TRANS_B={trans}: FAILED {type(e).__name__}: {str(e)[:800]}")

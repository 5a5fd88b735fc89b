"""The gate/up kernel's error bound against the exact value (test_op_gate_up_silu.py, and
test_op_amx_emulated.py's child, which must not import acarerank._cpu: torch only here).

Bound (per output, against SiLU(G)·U with G, U the exact fp64 products of the bf16 inputs): the
kernel's fp32 sums g, u are within γ_g = K·2⁻²⁴·(|x|·|W_g|ᵀ) of G (γ_u of U; the linear op's
bound, doubled as there). SiLU'(t) = σ(t)(1 + t(1 − σ(t))) lies in [−0.1, 1.1], so
    |SiLU(g)·u − SiLU(G)·U| ≤ 1.1·γ_g·(|U| + γ_u) + |SiLU(G)|·γ_u;
the SiLU's exp is within 3e-6 relative (exp2_avx512), which moves σ, hence the product, by as much;
three fp32 operations after it add 3·2⁻²⁴ < 1e-6 relative; the one bf16 rounding 2⁻⁹ relative,
taken as 2⁻⁸ as in the linear op's test. Hence
    |y − SiLU(G)·U| ≤ 2·(1.1·γ_g·(|U| + γ_u) + |SiLU(G)|·γ_u) + (2⁻⁸ + 4e-6)·|SiLU(G)·U|.
The plain linear (silu false) is the linear op's bound: 2·γ + 2⁻⁸·|y|.
"""
import torch

BF16 = torch.bfloat16


def gate_up_data(M, K, I, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * scale).to(BF16)
    w = (torch.randn(2 * I, K, generator=g) * K ** -0.5).to(BF16)
    return x, w


def exact(x, w):
    """(G, U, γ_g, γ_u): the exact fp64 products of the bf16 inputs and their fp32-sum bounds."""
    K, I = x.shape[-1], w.shape[0] // 2
    xd, wd = x.double(), w.double()
    gu, mag = xd @ wd.T, xd.abs() @ wd.abs().T
    gamma = K * 2.0 ** -24 * mag
    return gu[..., :I], gu[..., I:], gamma[..., :I], gamma[..., I:]


def check_silu(y, x, w, what):
    G, U, eg, eu = exact(x, w)
    silu_g = G * torch.sigmoid(G)
    want = silu_g * U
    bound = 2 * (1.1 * eg * (U.abs() + eu) + silu_g.abs() * eu) + (2.0 ** -8 + 4e-6) * want.abs()
    err = (y.double() - want).abs()
    bad = (err > bound).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} outputs over the bound; first at {bad[0].tolist()}: "
                              f"|diff| {err[tuple(bad[0])]:.3e} > {bound[tuple(bad[0])]:.3e} (y {y[tuple(bad[0])]}, "
                              f"exact {want[tuple(bad[0])]:.4e})")
    return err.max().item() if err.numel() else 0.0

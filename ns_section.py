# -----------------------------------------------------------------------------
# Orthogonalization for Muon ("Turbo-Muon")
#
# Replaces each matrix of a stack by an approximation of its polar factor U V^T
# (G = U S V^T) with odd quintic iterations  X <- a X + (b A + c A^2) X,  A = X X^T,
# run on the wide orientation (m <= n) so that A is the small m x m Gram matrix.
#
# Methods: "aol" (Turbo-Muon: AOL row scaling, a free by-product of the first Gram,
# guarantees ||X||_2 <= 1 without a Frobenius normalization, so one step is saved),
# "polar_express" and "newton_schulz" (Frobenius normalization, 5 steps each).
# AOL iterates on diag(s) G and so converges to its polar factor, not exactly G's:
# 0.3% relative on Gaussian 768x3072, more when row norms differ a lot.
# Backends: "torch" is the readable twin and the reference; "triton" runs the same
# algorithm with kernels that compute only half of every symmetric product.
# The Frobenius norm is read from the first Gram's diagonal (||X||_F^2 = tr XX^T),
# so every method's first step is "Gram, per-row scale s, then iterate on diag(s) X"
# and both backends share that one shape of first step.
# -----------------------------------------------------------------------------
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend and the FLOP counts work without triton
    triton = None
    tl = None

NS_METHODS = ("aol", "polar_express", "newton_schulz")
NS_BACKENDS = ("torch", "triton")

NEWTON_SCHULZ_COEFFS = [(3.4445, -4.7750, 2.0315)] * 5

# Greedy minimax composition for singular values in [1e-3, 1] (Amsel et al. 2025),
# safety factor 1.02 on all but the last step, cushion 0.02.
POLAR_EXPRESS_COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]

# AOL does the work of Polar Express's first step, so the public Turbo-Muon code
# runs Polar Express steps 2-5 after it. A table derived for the post-AOL spectrum
# (bench/derive_aol_coeffs.py) replaces this one; callers read the module attribute
# at call time, so assigning a new list here swaps it everywhere.
AOL_COEFFS = list(POLAR_EXPRESS_COEFFS[1:])

# Floors for the first-step scale. AOL's floor only guards all-zero rows (any row
# sum below it gets a smaller scale, which keeps the Schur bound); it is tiny so
# that gradients of any magnitude are normalized alike. The Frobenius offsets are
# the published ones of Newton-Schulz and Polar Express.
AOL_ROW_SUM_FLOOR = 1e-30
FROBENIUS_SAFETY = {"polar_express": 1.02, "newton_schulz": 1.0}
FROBENIUS_OFFSET = {"polar_express": 1e-6, "newton_schulz": 1e-7}


def default_coeffs(method: str) -> list:
    _check_choice("method", method, NS_METHODS)
    if method == "aol":
        return AOL_COEFFS
    if method == "polar_express":
        return POLAR_EXPRESS_COEFFS
    return NEWTON_SCHULZ_COEFFS


def _resolve_coeffs(method: str, coeffs: list | None) -> list:
    _check_choice("method", method, NS_METHODS)
    coeffs = default_coeffs(method) if coeffs is None else list(coeffs)
    if not coeffs:
        raise ValueError("need at least one (a, b, c) step: the first step applies the normalization")
    return coeffs


def _check_choice(what: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {allowed}")


def orthogonalize_flops(m: int, n: int, method: str, symmetric: bool, steps: int | None = None) -> float:
    """GEMM FLOPs to orthogonalize one m x n matrix (elementwise work not counted).

    Per step on the wide orientation: Gram 2m^2n, A@A 2m^3, B@X 2m^2n. The symmetric
    kernels compute half of the Gram and of A@A: 3m^2n + m^3 instead of 4m^2n + 2m^3.
    AOL's scaling reuses the first Gram, so it adds no GEMM.
    """
    _check_choice("method", method, NS_METHODS)
    m, n = min(m, n), max(m, n)
    if steps is None:
        steps = len(default_coeffs(method))
    per_step = 3 * m * m * n + m**3 if symmetric else 4 * m * m * n + 2 * m**3
    return float(steps * per_step)


def _as_wide_stack(G: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """View G as a (batch, m, n) stack with m <= n; True when it had to be transposed."""
    if G.ndim < 2:
        raise ValueError(f"expected a matrix or a stack of matrices, got shape {tuple(G.shape)}")
    stack = G.reshape(-1, *G.shape[-2:])
    tall = G.size(-2) > G.size(-1)
    return (stack.mT if tall else stack), tall


def _scale_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _row_abs_sum(A: torch.Tensor) -> torch.Tensor:
    return A.to(_scale_dtype(A)).abs().sum(-1)


def _first_step_row_scale(method: str, A: torch.Tensor, row_abs_sum: torch.Tensor | None) -> torch.Tensor:
    """Per-row scale s (batch, m) such that diag(s) X has spectral norm <= 1.

    AOL: s_i = 1/sqrt(sum_j |A_ij|) (Schur test). Frobenius methods: the same
    1/(safety*||X||_F + offset) for every row, ||X||_F^2 read from the Gram's trace.
    Computed in fp32, or fp64 for fp64 inputs.
    """
    if method == "aol":
        return torch.rsqrt(row_abs_sum.to(_scale_dtype(A)).clamp_min(AOL_ROW_SUM_FLOOR))
    frobenius = A.diagonal(dim1=-2, dim2=-1).to(_scale_dtype(A)).sum(-1).sqrt()
    inv_norm = 1.0 / (FROBENIUS_SAFETY[method] * frobenius + FROBENIUS_OFFSET[method])
    return inv_norm[:, None].expand(A.shape[:2]).contiguous()


def orthogonalize_torch(G: torch.Tensor, method: str = "aol", coeffs: list | None = None,
                        round_through: torch.dtype | None = None) -> torch.Tensor:
    """PyTorch twin of orthogonalize_triton: same scaling, same steps, in G's dtype.

    round_through (e.g. torch.bfloat16 with fp32 G) emulates low-precision GEMMs on
    CPU, where bf16 matmuls are slow: every product and scaled operand is rounded
    through that dtype, which is what bf16 GEMMs with fp32 accumulation do on GPU.
    """
    coeffs = _resolve_coeffs(method, coeffs)

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t if round_through is None else t.to(round_through).to(t.dtype)

    X, tall = _as_wide_stack(G)
    X = rounded(X)
    for step, (a, b, c) in enumerate(coeffs):
        A = rounded(X @ X.mT)
        if step == 0:
            s = _first_step_row_scale(method, A, _row_abs_sum(A) if method == "aol" else None)
            # Scale in fp32 and round once, as the kernels do when they load the tiles.
            A = rounded((A.to(s.dtype) * s[:, :, None] * s[:, None, :]).to(X.dtype))
            X = rounded((X.to(s.dtype) * s[:, :, None]).to(X.dtype))
        # baddbmm keeps b*A (resp. a*X) and the product in one fp32 accumulation on
        # GPU, matching the kernels' epilogues.
        B = rounded(torch.baddbmm(A, A, A, beta=b, alpha=c))
        X = rounded(torch.baddbmm(X, B, X, beta=a, alpha=1.0))
    if tall:
        X = X.mT
    return X.reshape(G.shape)


def aol_precondition(G: torch.Tensor) -> torch.Tensor:
    """diag(s) X as AOL's first step sees it (X = G on its wide orientation), in G's shape.

    All its singular values are <= 1; its smallest ones are what an AOL coefficient
    table has to lift to 1, so this is the matrix to measure when choosing the table.
    """
    X, tall = _as_wide_stack(G)
    A = X @ X.mT
    s = _first_step_row_scale("aol", A, _row_abs_sum(A))
    X = (X.to(s.dtype) * s[:, :, None]).to(X.dtype)
    return (X.mT if tall else X).reshape(G.shape)


def orthogonalize(G: torch.Tensor, method: str = "aol", backend: str = "torch",
                  coeffs: list | None = None) -> torch.Tensor:
    """Approximate polar factor of G, shape (m, n) or (..., m, n), in G's dtype.

    coeffs overrides the method's (a, b, c) table (one tuple per step).
    """
    _check_choice("method", method, NS_METHODS)
    _check_choice("backend", backend, NS_BACKENDS)
    if backend == "triton":
        return orthogonalize_triton(G, method, coeffs)
    return orthogonalize_torch(G, method, coeffs)


# ----------------------------------------------------------------------------- Triton
# Three kernels per step, each batched over the stack (grid axis 1 or 2 = matrix):
#   gram        A = X X^T            upper tiles only, each stored with its mirror
#   sym_poly    B = b A + c A A      upper tiles only (A A is symmetric too)
#   poly_apply  X' = a X + B X       all tiles, a X preloaded into the accumulator
# Accumulation is fp32; operands are fed to tl.dot in the input dtype (bf16 on GPU).
# In the first step the per-row scale s is applied to tiles as they are loaded, so
# diag(s) X and diag(s) A diag(s) are never written to memory.
# Any strides are accepted, so a tall matrix is processed as its transposed view and
# the last step writes straight into the caller's layout.

TRITON_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _square_tile_configs():
    # Symmetric kernels pair tile (i, j) with (j, i), so their tiles are square.
    if TRITON_INTERPRETING:  # the interpreter cannot benchmark: exactly one config
        return [triton.Config({"BLOCK_M": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": block, "BLOCK_K": 64}, num_warps=warps, num_stages=stages)
        for block in (64, 128)
        for warps in (4, 8)
        for stages in (3, 4)
    ]


def _rect_tile_configs():
    if TRITON_INTERPRETING:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64}, num_warps=warps, num_stages=stages)
        for bm, bn, warps in ((128, 128, 8), (128, 64, 4), (64, 128, 4), (64, 64, 4))
        for stages in (3, 4)
    ]


if triton is not None:

    @triton.jit
    def _upper_tile_pair(BLOCK_M: tl.constexpr):
        """Row and column indices of this program's tile pair (row tile <= column tile),
        and whether it is off the diagonal, i.e. has a mirror image to write."""
        # Pairs are numbered column by column: column c holds ids c(c+1)/2 ... c(c+1)/2 + c.
        # Invert with a square root; fp32 may land one off near perfect squares, so
        # nudge to the exact integer answer.
        tile_id = tl.program_id(0)
        tile_col = ((tl.sqrt(8.0 * tile_id.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
        tile_col = tl.where(tile_col * (tile_col + 1) // 2 > tile_id, tile_col - 1, tile_col)
        tile_col = tl.where((tile_col + 1) * (tile_col + 2) // 2 <= tile_id, tile_col + 1, tile_col)
        tile_row = tile_id - tile_col * (tile_col + 1) // 2
        rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_col * BLOCK_M + tl.arange(0, BLOCK_M)
        return rows, cols, tile_row != tile_col

    @triton.jit
    def _load_tile(ptr, rows, cols, stride_row, stride_col, n_rows, n_cols):
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=mask, other=0.0)

    @triton.jit
    def _store_symmetric_tile(ptr, tile, rows, cols, stride_row, stride_col, size, mirror):
        # Writes tile at (rows, cols) and, for off-diagonal tiles, its transpose at
        # (cols, rows): the mirror is a second store through swapped index arithmetic,
        # no data movement inside the tile.
        tile = tile.to(ptr.dtype.element_ty)
        mask = (rows[:, None] < size) & (cols[None, :] < size)
        tl.store(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, tile, mask=mask)
        if mirror:
            tl.store(ptr + rows[:, None] * stride_col + cols[None, :] * stride_row, tile, mask=mask)

    @triton.jit
    def _mma(left, right, acc, IEEE_FP32: tl.constexpr):
        # fp32 inputs would silently use TF32 on GPU; ask for full precision so that
        # fp32 runs stay comparable with the torch twin. bf16 inputs take the plain path.
        if IEEE_FP32:
            acc = tl.dot(left, right, acc, input_precision="ieee")
        else:
            acc = tl.dot(left, right, acc)
        return acc

    @triton.autotune(configs=_square_tile_configs(), key=["m", "k"], reset_to_zero=["row_abs_sum_ptr"])
    @triton.jit
    def _gram_kernel(
        x_ptr, a_ptr, row_abs_sum_ptr,
        m, k,
        stride_xb, stride_xm, stride_xk,
        stride_ab, stride_am, stride_an,
        stride_rb,
        WITH_ROW_ABS_SUM: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        rows, cols, off_diagonal = _upper_tile_pair(BLOCK_M)
        matrix = tl.program_id(1).to(tl.int64)
        x_ptr += matrix * stride_xb
        a_ptr += matrix * stride_ab
        inner = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            left = _load_tile(x_ptr, rows, k0 + inner, stride_xm, stride_xk, m, k)
            # X^T tile read through swapped strides rather than transposed in registers
            right = _load_tile(x_ptr, k0 + inner, cols, stride_xk, stride_xm, k, m)
            acc = _mma(left, right, acc, IEEE_FP32)
        _store_symmetric_tile(a_ptr, acc, rows, cols, stride_am, stride_an, m, off_diagonal)
        if WITH_ROW_ABS_SUM:
            # AOL row sums from the fp32 accumulator, in the same pass: a follow-up
            # kernel would re-read all of A (one more launch and m^2 reads per matrix)
            # and would sum bf16-rounded values. The price is atomics, whose order
            # varies run to run at fp32 rounding level, far below bf16 resolution.
            # A tile's rows get its row sums; the mirrored tile's rows (our columns)
            # get its column sums. Masked entries are exact zeros and add nothing.
            abs_tile = tl.abs(acc)
            row_abs_sum_ptr += matrix * stride_rb
            tl.atomic_add(row_abs_sum_ptr + rows, tl.sum(abs_tile, axis=1), mask=rows < m)
            if off_diagonal:
                tl.atomic_add(row_abs_sum_ptr + cols, tl.sum(abs_tile, axis=0), mask=cols < m)

    @triton.autotune(configs=_square_tile_configs(), key=["m"])
    @triton.jit
    def _sym_poly_kernel(
        a_ptr, b_ptr, scale_ptr,
        m, coef_b, coef_c,
        stride_ab, stride_am, stride_an,
        stride_bb, stride_bm, stride_bn,
        stride_sb,
        HAS_SCALE: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        rows, cols, off_diagonal = _upper_tile_pair(BLOCK_M)
        matrix = tl.program_id(1).to(tl.int64)
        a_ptr += matrix * stride_ab
        b_ptr += matrix * stride_bb
        scale_ptr += matrix * stride_sb
        inner = tl.arange(0, BLOCK_K)
        if HAS_SCALE:
            row_scale = tl.load(scale_ptr + rows, mask=rows < m, other=0.0)
            col_scale = tl.load(scale_ptr + cols, mask=cols < m, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, m, BLOCK_K):
            left = _load_tile(a_ptr, rows, k0 + inner, stride_am, stride_an, m, m)
            right = _load_tile(a_ptr, k0 + inner, cols, stride_am, stride_an, m, m)
            if HAS_SCALE:  # (diag(s) A diag(s)) tiles, built in registers
                inner_scale = tl.load(scale_ptr + k0 + inner, mask=k0 + inner < m, other=0.0)
                left = (left.to(tl.float32) * row_scale[:, None] * inner_scale[None, :]).to(a_ptr.dtype.element_ty)
                right = (right.to(tl.float32) * inner_scale[:, None] * col_scale[None, :]).to(a_ptr.dtype.element_ty)
            acc = _mma(left, right, acc, IEEE_FP32)
        a_tile = _load_tile(a_ptr, rows, cols, stride_am, stride_an, m, m)
        if HAS_SCALE:
            # Round the scaled tile to the input dtype, exactly like the dot operands,
            # so that b*A and c*A@A see the same A.
            a_tile = (a_tile.to(tl.float32) * row_scale[:, None] * col_scale[None, :]).to(a_ptr.dtype.element_ty)
        acc = coef_c * acc + coef_b * a_tile.to(tl.float32)
        _store_symmetric_tile(b_ptr, acc, rows, cols, stride_bm, stride_bn, m, off_diagonal)

    @triton.autotune(configs=_rect_tile_configs(), key=["m", "n"])
    @triton.jit
    def _poly_apply_kernel(
        b_ptr, x_ptr, out_ptr, scale_ptr,
        m, n, coef_a,
        stride_bb, stride_bm, stride_bk,
        stride_xb, stride_xm, stride_xn,
        stride_ob, stride_om, stride_on,
        stride_sb,
        HAS_SCALE: tl.constexpr, IEEE_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Consecutive programs share a row panel of B (grid axis 0 runs fastest).
        tile_col = tl.program_id(0)
        tile_row = tl.program_id(1)
        matrix = tl.program_id(2).to(tl.int64)
        b_ptr += matrix * stride_bb
        x_ptr += matrix * stride_xb
        out_ptr += matrix * stride_ob
        scale_ptr += matrix * stride_sb
        rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_col * BLOCK_N + tl.arange(0, BLOCK_N)
        inner = tl.arange(0, BLOCK_K)
        x_tile = _load_tile(x_ptr, rows, cols, stride_xm, stride_xn, m, n)
        if HAS_SCALE:
            row_scale = tl.load(scale_ptr + rows, mask=rows < m, other=0.0)
            x_tile = (x_tile.to(tl.float32) * row_scale[:, None]).to(x_ptr.dtype.element_ty)
        acc = coef_a * x_tile.to(tl.float32)
        for k0 in range(0, m, BLOCK_K):
            left = _load_tile(b_ptr, rows, k0 + inner, stride_bm, stride_bk, m, m)
            right = _load_tile(x_ptr, k0 + inner, cols, stride_xm, stride_xn, m, n)
            if HAS_SCALE:
                inner_scale = tl.load(scale_ptr + k0 + inner, mask=k0 + inner < m, other=0.0)
                right = (right.to(tl.float32) * inner_scale[:, None]).to(x_ptr.dtype.element_ty)
            acc = _mma(left, right, acc, IEEE_FP32)
        out_mask = (rows[:, None] < m) & (cols[None, :] < n)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _require_triton(*tensors: torch.Tensor) -> None:
    if triton is None:
        raise ValueError("backend 'triton' needs the triton package, which is not installed; use backend='torch'")
    for t in tensors:
        if not t.is_cuda and not TRITON_INTERPRETING:
            raise ValueError("backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"backend 'triton' supports bf16, fp16 and fp32, got {t.dtype}")


def _as_stack(t: torch.Tensor) -> torch.Tensor:
    return t if t.ndim == 3 else t.unsqueeze(0)


def _upper_tile_pairs(size: int, block: int) -> int:
    tiles = triton.cdiv(size, block)
    return tiles * (tiles + 1) // 2


def gram_triton(X: torch.Tensor, with_row_abs_sum: bool = False, out: torch.Tensor | None = None):
    """A = X X^T for X of shape (m, k) or (batch, m, k), any strides.

    Returns A, or (A, row_abs_sum) with row_abs_sum[..., i] = sum_j |A_ij| in fp32.
    """
    _require_triton(X)
    X3 = _as_stack(X)
    batch, m, k = X3.shape
    A = torch.empty(batch, m, m, dtype=X.dtype, device=X.device) if out is None else _as_stack(out)
    row_abs_sum = torch.zeros(batch, m, dtype=torch.float32, device=X.device) if with_row_abs_sum else A
    grid = lambda meta: (_upper_tile_pairs(m, meta["BLOCK_M"]), batch)
    _gram_kernel[grid](
        X3, A, row_abs_sum, m, k,
        *X3.stride(), *A.stride(), row_abs_sum.stride(0),
        WITH_ROW_ABS_SUM=with_row_abs_sum, IEEE_FP32=X.dtype == torch.float32,
    )
    A = A if X.ndim == 3 else A[0]
    if with_row_abs_sum:
        return A, (row_abs_sum if X.ndim == 3 else row_abs_sum[0])
    return A


def sym_poly_triton(A: torch.Tensor, b: float, c: float, scale: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """B = b A' + c A' A' for symmetric A, where A' = diag(scale) A diag(scale) (A' = A without scale)."""
    _require_triton(A)
    A3 = _as_stack(A)
    batch, m, _ = A3.shape
    B = torch.empty(batch, m, m, dtype=A.dtype, device=A.device) if out is None else _as_stack(out)
    if B.data_ptr() == A3.data_ptr():
        raise ValueError("sym_poly_triton cannot write in place: tiles read A after others wrote B")
    scale3 = None if scale is None else scale.float().reshape(batch, m).contiguous()
    grid = lambda meta: (_upper_tile_pairs(m, meta["BLOCK_M"]), batch)
    _sym_poly_kernel[grid](
        A3, B, A3 if scale3 is None else scale3, m, float(b), float(c),
        *A3.stride(), *B.stride(), 0 if scale3 is None else scale3.stride(0),
        HAS_SCALE=scale3 is not None, IEEE_FP32=A.dtype == torch.float32,
    )
    return B if A.ndim == 3 else B[0]


def poly_apply_triton(B: torch.Tensor, X: torch.Tensor, a: float, row_scale: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """a X' + B X' with X' = diag(row_scale) X (X' = X without row_scale); B is (.., m, m), X (.., m, n).

    out may be any strided view (e.g. the transposed view of a tall result) but must not overlap X or B.
    """
    _require_triton(B, X)
    B3, X3 = _as_stack(B), _as_stack(X)
    batch, m, n = X3.shape
    out3 = torch.empty(batch, m, n, dtype=X.dtype, device=X.device) if out is None else _as_stack(out)
    if out3.data_ptr() in (X3.data_ptr(), B3.data_ptr()):
        raise ValueError("poly_apply_triton cannot write in place: every output tile reads a whole column panel of X")
    scale3 = None if row_scale is None else row_scale.float().reshape(batch, m).contiguous()
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]), batch)
    _poly_apply_kernel[grid](
        B3, X3, out3, X3 if scale3 is None else scale3, m, n, float(a),
        *B3.stride(), *X3.stride(), *out3.stride(), 0 if scale3 is None else scale3.stride(0),
        HAS_SCALE=scale3 is not None, IEEE_FP32=X.dtype == torch.float32,
    )
    return out3 if X.ndim == 3 else out3[0]


def orthogonalize_triton(G: torch.Tensor, method: str = "aol", coeffs: list | None = None) -> torch.Tensor:
    """Kernel version of orthogonalize_torch (same algorithm); the result is contiguous in G's shape."""
    coeffs = _resolve_coeffs(method, coeffs)
    _require_triton(G)
    X, tall = _as_wide_stack(G)
    batch, m, n = X.shape
    result = torch.empty(G.shape, dtype=G.dtype, device=G.device)
    result_wide, _ = _as_wide_stack(result)
    # Two ping-pong buffers for the iterates; the first step reads G itself (through
    # its strides) and the last writes the result in G's own layout.
    iterates = [torch.empty(batch, m, n, dtype=G.dtype, device=G.device) for _ in range(min(2, len(coeffs) - 1))]
    A = torch.empty(batch, m, m, dtype=G.dtype, device=G.device)
    B = torch.empty_like(A)
    for step, (a, b, c) in enumerate(coeffs):
        s = None
        if step == 0:
            if method == "aol":
                _, row_abs_sum = gram_triton(X, with_row_abs_sum=True, out=A)
            else:
                gram_triton(X, out=A)
                row_abs_sum = None
            s = _first_step_row_scale(method, A, row_abs_sum)
        else:
            gram_triton(X, out=A)
        sym_poly_triton(A, b, c, scale=s, out=B)
        target = result_wide if step == len(coeffs) - 1 else iterates[step % 2]
        X = poly_apply_triton(B, X, a, row_scale=s, out=target)
    return result

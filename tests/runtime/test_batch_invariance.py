"""Batch invariance of the CPU backend's matrix product, weight type by weight type.

Speculative verification is lossless only if a verify's row computes bit for bit what a
one-row decode of the same position computes. ggml's CPU backend picks other kernels by
column count (repacked gemv against gemm, the tiled K-quant kernel from 16 columns,
llamafile's sgemm from 2) whose rounding differed; the project's ggml patches
(dflash_gguf/data/ggml-patches) make each column round as it does alone. This asks the
backend directly, for every weight type it runs, with and without the repacked layouts,
for column counts on both sides of every kernel switch (4 for gemm; 8, 12 and 16 for the
groups its AVX-512 gemm shares weights across, and their leftovers; 16 for the tiled
kernel, 17 past its narrow path; a prompt chunk's 515), whole output rows compared bit for
bit, no tolerance.

The DFLASH_TEST_DEVICE variant (pytest -m device, scripts/test-vulkan.sh) asks the device
under test the same and records the answer in the test's output.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from dflash_gguf.runtime.devices import matmul_invariance
from helpers.matrix import ci_subset

# every type ggml's CPU backend quantizes without an importance matrix and multiplies
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K,
         Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]
COLUMNS = [2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 20, 24, 28, 33, 515]


def _operands(n_in: int, n_out: int, n_cols: int, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, (n_out, n_in)).astype(np.float32)
    x = rng.normal(0, 1, (n_cols, n_in)).astype(np.float32)
    x[:, ::97] *= 30  # outliers, as real activations have: the 8-bit quantization's scale follows them
    return w, x


@pytest.mark.parametrize("repack", [True, False], ids=["repacked", "plain"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_every_column_rounds_as_it_does_alone(qtype, repack):
    # 1536 inputs (six K-quant super blocks), 64 outputs (eight 8-row repacked groups)
    for n_cols in COLUMNS:
        w, x = _operands(1536, 64, n_cols, seed=n_cols)
        n_differ, max_diff = matmul_invariance(qtype, w, x, repack=repack)
        assert n_differ == 0, (f"{qtype.name} ({'repacked' if repack else 'plain'}): {n_differ} of {n_cols} columns "
                               f"differ from the column alone (largest difference {max_diff:.3g})")


def test_a_bad_call_is_refused():
    w, x = _operands(64, 8, 2, seed=0)
    with pytest.raises(Exception, match="multiple of"):
        matmul_invariance(Q.Q4_K, w, x)  # 64 inputs: not a 256-wide K-quant block
    with pytest.raises(ValueError, match="expected"):
        matmul_invariance(Q.F32, w, x[:, :10])
    with pytest.raises(Exception, match="no device"):
        matmul_invariance(Q.F32, w, x, device="NoSuchDevice")


@pytest.mark.device
def test_the_device_under_test_reports_its_invariance(capsys):
    """Not every backend is batch-invariant (docs/exactness.md says which): the device's
    answer is printed per type; its columns may round apart, but only by rounding."""
    device = os.environ.get("DFLASH_TEST_DEVICE")
    if not device:
        pytest.skip("DFLASH_TEST_DEVICE names no device")
    rows = []
    for qtype in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K):
        got = {n: matmul_invariance(qtype, *_operands(1536, 64, n, seed=n), device=device) for n in (2, 4, 8, 16)}
        rows.append(f"{qtype.name}: " + ", ".join(f"{n} columns: {d} differ" for n, (d, _) in got.items()))
        # outputs are up to about 30 in size (the outlier columns): kernels that round the
        # activations to f16 or 8 bits otherwise move them by tenths (lavapipe's f16 product
        # at 16 columns: 0.24), a wrong product by whole units
        assert max(diff for _, diff in got.values()) < 1.0, (qtype.name, got)
    with capsys.disabled():
        print(f"\n[batch invariance on {device}]\n  " + "\n  ".join(rows))


# the column counts a patched device's verify must round as one column: every switch of
# each backend's kernels (CUDA's MMVQ/MMQ at 8/9, Vulkan's 8-column mul_mat_vec dispatches)
# on both sides, up to the backend's limit (CUDA 64: 0004; Vulkan 256: 0003); CUDA's 65,
# past its limit, is printed, not asserted (there the stock kernels take over)
DEVICE_COLUMNS = [2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 65, 128, 255, 256]
DEVICE_LIMITS = {"CUDA": 64, "Vulkan": 256}
# lavapipe compiles a type's shaders on first use, minutes for some; CI keeps the types of
# the models the device tests load and a few more (every type: pytest --full)
DEVICE_CI_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.Q2_K, Q.Q4_K, Q.Q6_K}


@pytest.mark.device
@pytest.mark.parametrize("qtype", ci_subset(TYPES, lambda t: t in DEVICE_CI_TYPES, [t.name for t in TYPES]))
def test_a_patched_device_rounds_each_verify_column_as_one_column(qtype, capsys):
    """CUDA with 0004's verify kernels (from 1 to 64 columns every count takes the
    one-column kernel) and Vulkan with 0003's (mul_mat_vec for every count up to 256, in
    8-column dispatches): each column must round bit for bit as it does alone, strict, for
    every type the CPU test covers. CUDA is unverified until a lent GPU runs this
    (scripts/cuda/device.sh)."""
    device = os.environ.get("DFLASH_TEST_DEVICE", "")
    limit = next((n for prefix, n in DEVICE_LIMITS.items() if device.startswith(prefix)), None)
    if limit is None:
        pytest.skip("DFLASH_TEST_DEVICE names no CUDA or Vulkan device")
    got = {n: matmul_invariance(qtype, *_operands(1536, 64, n, seed=n), device=device)
           for n in DEVICE_COLUMNS if n <= limit + 1}
    with capsys.disabled():
        differ = ", ".join(f"{n} columns: {d}" for n, (d, _) in got.items() if d)
        print(f"\n[{device}, {qtype.name}: columns that differ from the column alone] {differ or 'none'}")
    failures = [f"{n} columns: {d} differ (largest {diff:.3g})" for n, (d, diff) in got.items() if d and n <= limit]
    assert not failures, (qtype.name, failures)

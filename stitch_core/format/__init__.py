"""The format layer: what a version's bits are and how a patch of them is written and read.

Pure computation on tensors and bytes (no network, no engine, no board): dtypes and bit views
(`dtypes`), served views of master weights (`views`), fingerprints (`fingerprint`), the integer
entropy coder (`entropy`), one chunk's codec (`codec`), the patch header models (`header`), the
`.stp` container (`stp`), diff/apply (`patch`) and checkpoint files (`checkpoint`). Depends on no
other layer of `stitch_core`. Submodules import on use (the codec's numba kernels are not paid for
by a module that only needs dtypes).
"""

"""`stitch warm`: fill numba's on-disk cache with Stitch's kernels (`stitch_core.engine.warm`)."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_warm(a: argparse.Namespace) -> int:
    from stitch_core.engine.warm import warm

    if not a.json:
        print("stitch warm: compiling Stitch's kernels into numba's cache ...", file=sys.stderr,
              flush=True)
    r = warm()
    if a.json:
        print(json.dumps(r.to_dict()))
    else:
        print(f"stitch warm: {r.kernels} kernels; {r.compiled} signatures compiled, {r.loaded} "
              f"read from the cache, in {r.seconds:.1f} s (cache: {r.cache_dir})")
    return 0

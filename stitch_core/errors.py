"""The root of every error Stitch raises on purpose: `StitchError`.

Each layer's errors subclass it and keep the builtin base they always had (a `PatchError` is still
a `ValueError`, a `BoardError` a `RuntimeError`), so callers can catch Stitch's failures as one
family (the CLI turns any of them into exit 1 and a one-line message) without breaking code that
caught the builtin. Pure: no imports.
"""


class StitchError(Exception):
    """Base class of Stitch's own errors: corrupt or refused input, unreachable or inconsistent
    boards, an engine state that cannot be proven."""

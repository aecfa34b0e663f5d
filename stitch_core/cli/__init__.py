"""The `stitch` command line, the top of `stitch_core`: patch verbs (`main`: diff, apply,
inspect) and version verbs (`versions`: up, pull, versions, status, board). Verbs of other
packages plug in through the ``stitch.cli`` entry-point group (`stitch_trainer` adds ``publish``
and ``analyze``), so the core imports no trainer."""

from stitch_core.cli.main import build_parser, main

__all__ = ["build_parser", "main"]

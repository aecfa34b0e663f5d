"""The `stitch` CLI builds only the chosen verb's parsers and imports only what that verb runs,
with the same verbs, help and errors as the full parser."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from stitch_core.cli import build_parser
from stitch_core.cli.main import GROUPS, parse_args


def _verbs(p: argparse.ArgumentParser) -> list[str]:
    return list(p._subparsers._group_actions[0].choices)  # noqa: SLF001


def test_each_group_adds_exactly_its_verbs_in_the_full_parsers_order():
    core = []
    for verbs, add in GROUPS:
        sub = argparse.ArgumentParser(prog="stitch").add_subparsers(dest="cmd")
        add(sub)
        assert tuple(sub.choices) == verbs
        core += verbs
    assert _verbs(build_parser())[: len(core)] == core


def test_diff_imports_neither_the_board_stack_nor_a_plugin():
    code = (
        "import sys\n"
        "from stitch_core.cli.main import parse_args\n"
        "a = parse_args(['diff', 'a', 'b', '-o', 'p.stp'])\n"
        "assert a.fn.__name__ == 'cmd_diff', a.fn\n"
        "import stitch_core.cli.patches\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('stitch_core.versions',"
        " 'stitch_core.cli.versions', 'stitch_core.cli.squash', 'stitch_core.settings',"
        " 'stitch_trainer', 'cryptography')))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("argv", [["nosuch"], ["diff", "a", "b", "-o", "x", "--bogus"],
                                  ["diff", "a", "b"], ["gc", "b", "--run", "r",
                                                       "--keep-snapshots", "0"]])
def test_a_parse_error_is_the_full_parsers(argv, capsys):
    with pytest.raises(SystemExit) as one:
        parse_args(argv)
    got = capsys.readouterr()
    with pytest.raises(SystemExit) as full:
        build_parser().parse_args(argv)
    assert (one.value.code, got) == (full.value.code, capsys.readouterr())


def test_a_plugin_verb_parses_as_in_the_full_parser(capsys):
    argv = ["analyze", "-h"]
    with pytest.raises(SystemExit) as full:
        build_parser().parse_args(argv)
    want = capsys.readouterr()
    with pytest.raises(SystemExit) as one:
        parse_args(argv)
    assert (one.value.code, capsys.readouterr()) == (full.value.code, want)
    assert "analyze" in want.out

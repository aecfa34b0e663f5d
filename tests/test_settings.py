"""One typed settings object: units parsed, bad values refused by name, the docs table generated
from it, one failpoint variable, and no STITCH_* variable read anywhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from stitch_core import failpoints
from stitch_core.errors import StitchError
from stitch_core.settings import (
    APPLY_MEMORY,
    BEGIN,
    END,
    MAX_BODY_BYTES,
    Settings,
    SettingsError,
    env_name,
    markdown_table,
    parse_bytes,
    parse_duration,
    with_table,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text, n", [("12345", 12345), ("64MiB", 64 << 20), ("8GiB", 8 << 30),
                                     ("500MB", 500_000_000), ("1.5GiB", 3 << 29),
                                     ("8 gib", 8 << 30), ("0", 0), (4096, 4096)])
def test_byte_sizes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text, s", [("10", 10.0), ("10s", 10.0), ("500ms", 0.5), ("2m", 120.0),
                                     ("1h", 3600.0), ("0.25", 0.25), (3, 3.0)])
def test_durations(text, s):
    assert parse_duration(text) == s


def test_units_through_the_environment():
    s = Settings.from_env({"STITCH_MAX_BODY_BYTES": "32MiB", "STITCH_APPLY_MEMORY": "3GiB",
                           "STITCH_CACHE_MAX_BYTES": "8GiB", "STITCH_RPC_TIMEOUT": "500ms",
                           "STITCH_MAX_WAIT": "2m", "STITCH_VERIFY_COOLDOWN": "10s",
                           "STITCH_LOG_LEVEL": "debug", "STITCH_BOARD": ""})
    assert (s.max_body_bytes, s.apply_memory, s.cache_max_bytes) == (32 << 20, 3 << 30, 8 << 30)
    # none of them is its default: a variable that was ignored would fail here
    assert s.max_body_bytes != MAX_BODY_BYTES and s.apply_memory != APPLY_MEMORY
    assert (s.rpc_timeout, s.max_wait, s.verify_cooldown) == (0.5, 120.0, 10.0)
    assert s.log_level == "DEBUG" and s.board is None  # an empty variable is unset
    assert Settings().apply_memory == APPLY_MEMORY


@pytest.mark.parametrize("var, value", [("STITCH_MAX_BODY_BYTES", "64 parsecs"),
                                        ("STITCH_CACHE_MAX_BYTES", "-5"),
                                        ("STITCH_RPC_TIMEOUT", "soon"),
                                        ("STITCH_DRAIN_TIMEOUT", "-1s"),
                                        ("STITCH_MAX_WAIT", "inf"),
                                        ("STITCH_APPLY_MODE", "lazy"),
                                        ("STITCH_PAUSE_STEPS", "maybe"),
                                        ("STITCH_LOG_LEVEL", "LOUD"),
                                        ("STITCH_SGLANG", "perhaps")])
def test_a_bad_value_is_refused_naming_the_variable_and_the_value(var, value):
    with pytest.raises(SettingsError) as e:
        Settings.from_env({var: value, "STITCH_BOARD": "/b"})
    assert f"{var}={value!r}" in str(e.value)
    assert isinstance(e.value, StitchError) and isinstance(e.value, ValueError)


def test_read_parses_one_variable_only():
    env = {"STITCH_MAX_BODY_BYTES": "huge", "STITCH_RUN": "r"}
    assert Settings.read("run", env) == "r"  # the bad neighbour is not its business
    with pytest.raises(SettingsError, match="STITCH_MAX_BODY_BYTES"):
        Settings.read("max_body_bytes", env)
    with pytest.raises(KeyError):
        Settings.read("no_such_setting", env)


def test_the_docs_table_is_the_rendering():
    """docs/engines.md's table is `markdown_table()`: regenerate it with
    `python -m stitch_core.settings --write docs/engines.md`."""
    page = (ROOT / "docs" / "engines.md").read_text()
    assert BEGIN in page and END in page
    assert with_table(page) == page, "docs/engines.md is stale: python -m stitch_core.settings " \
                                     "--write docs/engines.md"
    table = markdown_table()
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no description"
        if not (field.json_schema_extra or {}).get("tool"):
            assert f"| `{env_name(name)}` |" in table
    assert "STITCH_GATEWAY_API_KEY" in markdown_table(tools=True)


def test_failpoints_one_variable():
    assert failpoints.ENV == "STITCH_FAILPOINTS"
    assert not failpoints.enabled({})
    assert failpoints.enabled({"STITCH_FAILPOINTS": "1"})
    both = {"STITCH_FAILPOINTS": "1, publish:after-object"}
    assert failpoints.enabled(both)
    assert failpoints.active(both) == {"1", "publish:after-object"}
    assert not failpoints.enabled({"STITCH_FAILPOINTS": "publish:after-object"})


_STITCH = re.compile(r"^STITCH_")
OWNERS = {"stitch_core/settings.py"}


def _env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Lines that read os.environ / os.getenv: with a literal STITCH_* name, or any name at all
    when the call's argument is not a literal (a name held elsewhere)."""
    found = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call):
            f = node.func
            reads = isinstance(f, ast.Attribute) and (f.attr == "getenv" or (
                f.attr in ("get", "pop", "setdefault") and isinstance(f.value, ast.Attribute)
                and f.value.attr == "environ"))
            if not reads:
                continue
            target = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "environ":
            target = node.slice
        else:
            continue
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            if _STITCH.match(target.value):
                found.append((node.lineno, target.value))
        else:
            found.append((node.lineno, ast.unparse(target) if target is not None else "?"))
    return found


def test_no_module_but_settings_reads_a_stitch_variable():
    bad = []
    for pkg in ("stitch_core", "stitch_vllm", "stitch_sglang"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in OWNERS:
                continue
            src = path.read_text()
            bad += [f"{rel}:{line}: {what}" for line, what in _env_reads(ast.parse(src))]
            # a STITCH_ name written out in code (not in a docstring or comment) is an owner
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        re.fullmatch(r"STITCH_[A-Z_]+", node.value):
                    bad.append(f"{rel}:{node.lineno}: names {node.value}")
    assert bad == []


def test_the_scan_finds_a_read():
    src = ("import os\na = os.environ.get('STITCH_X')\nb = os.getenv('STITCH_Y')\n"
           "c = os.environ['STITCH_Z']\nd = os.environ.get(NAME)\ne = os.environ.get('HOME')\n")
    assert [w for _, w in _env_reads(ast.parse(src))] == ["STITCH_X", "STITCH_Y", "STITCH_Z",
                                                            "NAME"]

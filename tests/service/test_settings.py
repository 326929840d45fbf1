"""Every setting described once (``service/config.py``): ``serve``'s flags, their parsing back into a
``ServiceConfig``, the range checks and docs/settings.md are all made from the settings."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from common import REPO

from shardfeed.cli import build_parser, main
from shardfeed.retry import Backoff
from shardfeed.service.config import (OPTIONS, Group, HedgePolicy, MachineBound, ServiceConfig,
                                      render_settings_table, serve_settings, settings)
from shardfeed.service import server
from shardfeed.service.server import add_arguments, config_from_args

SERVE_FLAGS = """
--host --port --node --idle-exit --workers --restart-pause --dataset --index-objects --bucket --object-ttl --data-dir
--cache-dir --cache-size --memory-cache --cache-writes --block-size --merge-gap --fetch-window --ranges-first
--max-store-requests --store-timeout --store-retries --hedge --no-hedge --hedge-quantile --hedge-min-ms --hedge-max-ms
--hedge-budget --sample-window-ms --max-batch --max-inflight-batches --max-inflight-samples --max-plans
--max-plan-samples --plan-ttl --plan-ahead --plan-memory --range-gap --token-file --tokens --node-id --peers
--peers-from --peers-refresh --peer-timeout --tls-cert --tls-key --log-level --log-file
""".split()
"""The flags ``serve`` took before they were made from the settings: each is kept."""


@pytest.fixture
def parse(monkeypatch):
    monkeypatch.delenv("SHARDFEED_TOKENS", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return lambda *argv: config_from_args(parser.parse_args(argv))


def test_the_settings_page_is_the_one_the_settings_make():
    page = (REPO / "docs" / "settings.md").read_text()
    assert page == render_settings_table(), \
        "docs/settings.md is stale: python -m shardfeed.service.config > docs/settings.md"


def test_the_page_lists_every_flag_once_with_a_row_each():
    rows = re.findall(r"^\| `(--[a-z-]+)", render_settings_table(), re.M)
    assert sorted(rows) == sorted(s.flag for s in serve_settings())
    assert len(set(rows)) == len(rows)


def test_serve_help_lists_every_flag_it_took_in_its_groups():
    parser, subparsers = build_parser()
    add_arguments(subparsers["serve"])
    text = subparsers["serve"].format_help()
    assert set(SERVE_FLAGS) <= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    titles = [text.index(f"\n{group.value}:\n") for group in Group]
    assert titles == sorted(titles)
    cache = text[text.index(f"\n{Group.CACHE.value}:\n"):text.index(f"\n{Group.READS.value}:\n")]
    assert "--block-size SIZE" in cache and "(default: 1MiB; between 4KiB and 1GiB)" in " ".join(cache.split())


def test_no_flag_leaves_every_default_of_the_config(parse):
    assert parse() == ServiceConfig()


@pytest.mark.parametrize("argv, name, value", [
    (["--cache-size", "500GiB"], "cache_size", 500 << 30),
    (["--cache-writes", "buffered"], "direct_writes", False),
    (["--ranges-first", "on"], "ranges_first", True),
    (["--sample-window-ms", "5"], "sample_window", 0.005),
    (["--index-objects"], "index_objects", True),
    (["--bucket", "b-one", "--bucket", "b-two", "--bucket", "b-one"], "buckets", ("b-one", "b-two")),
    (["--dataset", "a=file:///a", "--dataset", "b=s3://b/c"], "datasets", {"a": "file:///a", "b": "s3://b/c"}),
    (["--tokens", "tenants.toml"], "tenant_file", Path("tenants.toml")),
    (["--no-hedge"], "hedge", None),
    (["--hedge-min-ms", "5", "--hedge-quantile", "0.5"], "hedge", HedgePolicy(quantile=0.5, min_delay=0.005)),
    (["--store-timeout", "7", "--store-retries", "2"], "store_options",
     {"read_timeout": 7.0, "backoff": Backoff(attempts=3)}),
    (["--store-first-byte-timeout", "1.5", "--store-progress-timeout", "0.5"], "store_options",
     {"first_byte_timeout": 1.5, "progress_timeout": 0.5}),
    (["--workers", "1", "--restart-pause", "0.5", "--peers-refresh", "1"], "restart_pause", 0.5),
])
def test_each_flag_sets_its_field_in_the_field_s_units(parse, monkeypatch, tmp_path, argv, name, value):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tenants.toml").write_text('[reader]\nsecret = "7f3e9c0d2b41aa96e0c5"\nscopes = ["admin"]\n')
    assert getattr(parse(*argv), name) == value


def test_the_node_service_s_defaults_yield_to_its_flags(parse, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    node = parse("--node")
    assert (node.port, node.idle_exit, node.cache_dir) == (0, 900.0, tmp_path / "shardfeed" / "cache")
    assert len(node.tokens) == 1  # a token of its own
    told = parse("--node", "--port", "9000", "--idle-exit", "0", "--cache-dir", "here")
    assert (told.port, told.idle_exit, told.cache_dir) == (9000, 0.0, Path("here"))


def bounded() -> list:
    return [s for s in [*settings(ServiceConfig), *OPTIONS] if s.bounds()]


@pytest.mark.parametrize("described", bounded(), ids=lambda s: s.flag)
def test_every_range_is_checked_and_the_error_names_the_flag(described):
    high = described.high.value() if isinstance(described.high, MachineBound) else described.high
    wrong = [*([described.low - 1] if described.low is not None else []),
             *([0] if described.positive else []),
             *([high * 2 + 1] if high is not None else [])]
    for value in wrong:
        with pytest.raises(ValueError, match=f"^{described.flag} must be {re.escape(described.bounds(here=True))}, "):
            if described.owner is None:
                described.check(value)
            else:
                ServiceConfig(**{described.name: type(described.default)(value)})
    edges = [edge for edge in (described.low, high) if edge is not None]
    if described.owner is not None:
        for edge in edges:
            ServiceConfig(**{described.name: type(described.default)(edge)})


@pytest.mark.parametrize("args, message", [
    (["--sample-window-ms", "2000"], "--sample-window-ms must be between 0 ms and 1000 ms, not 2000 ms"),
    (["--store-retries", "-1"], "--store-retries must be at least 0, not -1"),
    (["--memory-cache", "1000TiB"], "--memory-cache must be between 0B and "),
    (["--plan-ttl", "0.5"], "--plan-ttl must be between 1 s and 7 days, not 0.5 s"),
])
def test_a_value_out_of_range_is_a_one_line_error_and_a_failed_exit(tmp_path, capsys, monkeypatch, args, message):
    def served(*_args, **_kwargs):
        raise AssertionError("served: the value was not refused")

    for start in ("supervise", "_listening"):  # a value let through fails this test, not serve on
        monkeypatch.setattr(server, start, served)
    assert main(["serve", "--cache-dir", str(tmp_path), *args]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"shardfeed: error: {message}") and err.count("\n") == 1

"""One grammar for every command that reads a config: `--config FILE` and the argument FILE are
the same, given once (issue 28, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from guard.cli import _resolve_config, build_parser, main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "deploy/kubernetes/overlays/example/guard.yaml")
MATRIX = str(ROOT / "configs/matrix/cpu.yaml")

# Every command that reads a config, with the other arguments it needs.
COMMANDS = [
    (["serve"], [], EXAMPLE),
    (["config", "validate"], [], EXAMPLE),
    (["deploy", "rules"], [], EXAMPLE),
    (["deploy", "rollout"], ["--kind", "argo"], EXAMPLE),
    (["deploy", "envoy"], [], EXAMPLE),
    (["deploy", "istio"], ["--selector", "app=m"], EXAMPLE),
    (["matrix"], [], MATRIX),
]


def parsed(argv: list[str]):
    args = build_parser().parse_args(argv)
    _resolve_config(args)
    return args


@pytest.mark.parametrize("command,extra,config", COMMANDS, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else None)
def test_both_spellings_name_the_same_config(command, extra, config):
    by_flag = parsed([*command, "--config", config, *extra])
    by_argument = parsed([*command, config, *extra])
    assert by_flag.config == by_argument.config == config
    assert by_flag.file == by_argument.file == config


def test_replay_takes_the_config_either_way():
    by_flag = parsed(["replay", "--config", EXAMPLE, "a.gcap", "b/"])
    by_argument = parsed(["replay", EXAMPLE, "a.gcap", "b/"])
    for args in (by_flag, by_argument):
        assert args.config == EXAMPLE and args.captures == ["a.gcap", "b/"]


def test_a_config_given_twice_or_not_at_all_is_one_clear_line(capsys):
    assert main(["deploy", "rules", EXAMPLE, "--config", "other.yaml"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"guard: the config is given twice ('{EXAMPLE}' and --config 'other.yaml'): give FILE "
        "or --config FILE")
    assert main(["deploy", "rules"]) == 2
    assert capsys.readouterr().err.strip() == (
        "guard: guard deploy rules: a config file is needed: --config FILE (or FILE)")


def test_the_same_config_both_ways_gives_the_same_rules(capsys):
    assert main(["deploy", "rules", "--config", EXAMPLE]) == 0
    by_flag = capsys.readouterr().out
    assert main(["deploy", "rules", EXAMPLE]) == 0
    assert capsys.readouterr().out == by_flag and "groups:" in by_flag


def test_admin_reads_its_address_from_the_config(tmp_path):
    from guard.admin_client import admin_address_of
    from guard.errors import ConfigError, GuardError

    config = tmp_path / "guard.yaml"
    config.write_text("version: 1\nserver: {admin_port: 9123}\nmodels: []\n")
    assert admin_address_of(str(config)) == "127.0.0.1:9123"
    config.write_text("version: 1\nserver: {admin_port: 9123, admin_host: '::1'}\n")
    assert admin_address_of(str(config)) == "[::1]:9123"
    config.write_text("version: 1\nserver: {admin_port: 0}\n")
    with pytest.raises(GuardError, match=r"server.admin_port is 0"):
        admin_address_of(str(config))
    config.write_text("version: 1\nserver: {admin_prot: 1}\n")
    with pytest.raises(ConfigError) as info:
        admin_address_of(str(config))
    assert info.value.problems == ["server.admin_prot: unknown key"]
    args = build_parser().parse_args(["admin", "--config", str(config), "status"])
    assert args.config == str(config) and args.admin is None

"""Flags read off the config dataclasses (service_common/config_flags.py): every config field of
both services is a flag or named here as code-only, every flag is a field or named here as the
server's own, and what a flag parses into reaches its field and nothing else."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field

import pytest

from executor_svc.config import EngineConfig
from executor_svc.flags import build_parser as executor_parser
from executor_svc.flags import config_from_args as executor_config
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.main import build_parser as scheduler_parser
from scheduler_svc.main import config_from_args as scheduler_config
from service_common.config_flags import add_config_flags, config_from_flags, flag, flag_fields

# Flags both services take that no config field holds: logs and telemetry are set up from them directly.
OBSERVABILITY_FLAGS = {"--log-format", "--log-level", "--otlp-endpoint", "--trace-sample-ratio", "--metrics-port"}

SERVICES = {
    # parser, config from args, config class, fields only code sets, flags only the server reads
    "executor": (
        executor_parser,
        executor_config,
        EngineConfig,
        set(),
        {"--listen", "--no-calibration", "--scheduler-token-file", "--tls-cert", "--tls-key"} | OBSERVABILITY_FLAGS,
    ),
    "scheduler": (
        scheduler_parser,
        scheduler_config,
        SchedulerConfig,
        {"kv_watermark", "executor_timeout_s", "connect_timeout_s", "min_prefill_chunk"},
        OBSERVABILITY_FLAGS,
    ),
}

# Values for fields a number or a free word cannot stand for (validated, or checked together).
STRING_VALUES = {
    "device": "cpu",
    "spec": "fixed:3",
    "http_listen": "127.0.0.1:9000",
    "block_size": 64,  # a power of two
}
# Flags counting in other units than their field: (flag value, the field's value).
UNIT_VALUES = {
    "kv_cache_bytes": ("0.5", 1 << 29),
    "decode_latency_target_s": ("50", 0.05),
    "decode_runs_window_s": ("25", 0.025),
}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}


@pytest.mark.parametrize("service", SERVICES)
def test_every_config_field_is_a_flag_and_every_flag_a_field(service):
    build_parser, _, config_cls, code_only, server_only = SERVICES[service]
    flagged = {f.name: spec.name for f, spec in flag_fields(config_cls)}
    assert {f.name for f in dataclasses.fields(config_cls)} - flagged.keys() == code_only
    field_options = set(flagged.values())
    field_options |= {"--no-" + spec.name.removeprefix("--") for _, spec in flag_fields(config_cls) if spec.both_ways}
    assert _options(build_parser()) == field_options | server_only
    assert not field_options & server_only


@pytest.mark.parametrize("service", SERVICES)
def test_no_flags_give_the_default_config(service):
    build_parser, config_from_args, config_cls, _, _ = SERVICES[service]
    assert config_from_args(build_parser().parse_args([])) == config_cls()


def _other_value(f: dataclasses.Field, field_type, default, spec, index: int) -> tuple[list[str], object]:
    """A flag's argv for a value not the field's default, and the field's value it stands for."""
    if f.name in UNIT_VALUES:
        text, value = UNIT_VALUES[f.name]
        return [spec.name, text], value
    if field_type is bool:
        if spec.both_ways:
            return [spec.name if not default else f"--no-{spec.name[2:]}"], not default
        return [spec.name], not default
    if spec.choices:
        value = next(c for c in spec.choices if c != default)
    elif f.name in STRING_VALUES:
        value = STRING_VALUES[f.name]
    elif field_type in (int, float):
        value = field_type((default or 0) + 2 + index)  # distinct, so two fields swapped would show
    else:
        value = f"{f.name}-value"
    return [spec.name, str(value)], value


@pytest.mark.parametrize("service", SERVICES)
def test_each_flag_reaches_its_field(service):
    build_parser, config_from_args, config_cls, _, _ = SERVICES[service]
    hints = typing.get_type_hints(config_cls)
    defaults = config_cls()
    argv, expected = [], {}
    for index, (f, spec) in enumerate(flag_fields(config_cls)):
        field_type = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
        args, value = _other_value(f, field_type, getattr(defaults, f.name), spec, index)
        assert value != getattr(defaults, f.name), f.name
        argv += args
        expected[f.name] = value
    config = config_from_args(build_parser().parse_args(argv))
    assert {name: getattr(config, name) for name in expected} == expected


def test_argparse_names_stay_the_flags_own():
    """Deployment files and tests read the parsed flags by the flag's name, not the field's."""
    args = executor_parser().parse_args(["--threads", "3", "--kv-cache-gb", "2", "--no-prefix-caching"])
    assert (args.threads, args.kv_cache_gb, args.no_prefix_caching) == (3, 2.0, True)
    args = scheduler_parser().parse_args(["--decode-runs-window-ms", "20", "--no-async-scheduling"])
    assert (args.decode_runs_window_ms, args.async_scheduling) == (20.0, False)


def test_both_services_take_the_same_tls_flags():
    def tls(parser):
        return [
            (a.option_strings, a.default, a.type, a.help) for a in parser._actions if a.dest in ("tls_cert", "tls_key")
        ]

    assert tls(executor_parser()) == tls(scheduler_parser())
    assert len(tls(executor_parser())) == 2


def test_a_switch_that_changes_nothing_is_refused():
    @dataclass(frozen=True)
    class AlreadyOn:
        enabled: bool = field(default=True, metadata=flag("--enabled"))

    with pytest.raises(ValueError, match="--enabled: a switch for enabled"):
        add_config_flags(argparse.ArgumentParser(), AlreadyOn)


def test_only_a_boolean_field_takes_a_switch():
    @dataclass(frozen=True)
    class Count:
        count: int = field(default=1, metadata=flag("--no-count", negated=True))

    with pytest.raises(ValueError, match="only a boolean field"):
        add_config_flags(argparse.ArgumentParser(), Count)


def test_a_bad_value_fails_in_the_config_naming_the_flag():
    parser = executor_parser()
    with pytest.raises(ValueError, match="^--block-size must be a power of two, got 24$"):
        config_from_flags(EngineConfig, parser.parse_args(["--block-size", "24"]))


@pytest.mark.parametrize(
    "main,argv,expected",
    [
        ("executor", ["--draft-max-ngram", "0"], "swarmserve-executor: error: --draft-max-ngram must be >= 1, got 0"),
        ("executor", ["--max-draft-tokens", "-1"], "error: --max-draft-tokens must be >= 0, got -1"),
        (
            "scheduler",
            ["--max-num-batched-tokens", "0"],
            "swarmserve-scheduler: error: --max-num-batched-tokens must be positive, got 0",
        ),
    ],
)
def test_a_flag_its_config_refuses_is_a_usage_error_before_anything_starts(main, argv, expected, capsys):
    """Exit status 2 and the flag as typed, from the service's own command (not a traceback after
    it started listening, as the executor gave before)."""
    from executor_svc.main import main as executor_main
    from scheduler_svc.main import main as scheduler_main

    with pytest.raises(SystemExit) as exited:
        {"executor": executor_main, "scheduler": scheduler_main}[main](argv)
    assert exited.value.code == 2
    assert expected in capsys.readouterr().err


def test_refusals_name_the_flag_not_the_field():
    @dataclass(frozen=True)
    class Config:
        max_tokens: int = field(default=1, metadata=flag("--max-tokens"))
        max_tokens_total: int = field(default=2, metadata=flag("--budget"))

        def __post_init__(self):
            if self.max_tokens > self.max_tokens_total:
                raise ValueError(f"max_tokens ({self.max_tokens}) exceeds max_tokens_total")

    parser = argparse.ArgumentParser()
    add_config_flags(parser, Config)
    with pytest.raises(ValueError, match=r"^--max-tokens \(5\) exceeds --budget$"):
        config_from_flags(Config, parser.parse_args(["--max-tokens", "5"]))

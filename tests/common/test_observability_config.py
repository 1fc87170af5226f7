"""The observability plumbing in small: tracing configuration (flags over OTEL_* variables,
off by default), parent-based sampling, trace ids in log lines (ours and the libraries'),
the serve pass-through of the new flags, and the container health probe."""

from __future__ import annotations

import json
import logging

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from clients.cli import parse_args
from clients.health_probe import main as health_probe
from clients.serve import ServeConfig, executor_command, scheduler_command
from executor_svc.flags import build_parser as executor_parser
from scheduler_svc.main import build_parser as scheduler_parser
from service_common.observability.flags import tracing_config
from service_common.observability.logs import configure_logging
from service_common.observability.tracing import TracingConfig, build_tracer_provider
from tests.support.stack import free_port


def test_tracing_is_off_without_an_endpoint():
    config = TracingConfig.resolve(None, None, "swarmserve-scheduler", environ={})
    assert not config.is_enabled and config.sample_ratio == 1.0 and config.service_name == "swarmserve-scheduler"
    assert build_tracer_provider(config) is None


def test_standard_variables_configure_tracing_and_flags_win():
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_SERVICE_NAME": "agents-scheduler",
    }
    config = TracingConfig.resolve(None, None, "swarmserve-scheduler", environ=env)
    assert (config.otlp_endpoint, config.sample_ratio, config.service_name) == (
        "http://collector:4317",
        0.25,
        "agents-scheduler",
    )
    traces_only = TracingConfig.resolve(
        None, None, "x", environ={**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317"}
    )
    assert traces_only.otlp_endpoint == "http://t:4317"
    flags = scheduler_parser().parse_args(["--otlp-endpoint", "http://here:4317", "--trace-sample-ratio", "0.5"])
    config = tracing_config(flags, "swarmserve-scheduler", environ=env)
    assert (config.otlp_endpoint, config.sample_ratio) == ("http://here:4317", 0.5)
    for disabled in ({"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}):
        assert not TracingConfig.resolve(None, None, "x", environ={**env, **disabled}).is_enabled


@pytest.mark.parametrize("parser", [executor_parser, scheduler_parser])
def test_bad_observability_flags_are_usage_errors(parser):
    for argv in (["--trace-sample-ratio", "1.5"], ["--metrics-port", "70000"], ["--metrics-port", "-1"]):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)
    with pytest.raises(ValueError):
        TracingConfig.resolve(None, None, "x", environ={"OTEL_TRACES_SAMPLER_ARG": "lots"})
    args = parser().parse_args([])
    assert args.metrics_port == 0 and args.otlp_endpoint is None and args.trace_sample_ratio is None


def test_sampling_is_parent_based_trace_id_ratio():
    exporter = InMemorySpanExporter()
    provider = build_tracer_provider(TracingConfig(sample_ratio=0.0), SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    assert not tracer.start_span("root").is_recording()  # ratio 0: no new trace is sampled
    sampled_parent = SpanContext(
        trace_id=1 << 64, span_id=7, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
    )
    child = tracer.start_span("child", context=trace.set_span_in_context(NonRecordingSpan(sampled_parent)))
    assert child.is_recording()  # ... but a sampled parent's children are, on either service
    child.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["child"]
    every = build_tracer_provider(TracingConfig(sample_ratio=1.0), SimpleSpanProcessor(exporter)).get_tracer("t")
    assert every.start_span("root").is_recording()


@pytest.fixture
def restore_logging():
    """configure_logging changes process-wide state: put structlog and the root logger back."""
    root_handlers, root_level = logging.getLogger().handlers[:], logging.getLogger().level
    yield
    structlog.reset_defaults()
    logging.getLogger().handlers[:] = root_handlers
    logging.getLogger().setLevel(root_level)


def test_log_lines_are_json_with_bound_ids_and_the_current_span(restore_logging, capsys):
    configure_logging("json", "info")
    provider = build_tracer_provider(TracingConfig(), SimpleSpanProcessor(InMemorySpanExporter()))
    log = structlog.get_logger()
    with structlog.contextvars.bound_contextvars(request_id="r1", step_id=3):
        with provider.get_tracer("t").start_as_current_span("step") as span:
            log.info("inside")
            logging.getLogger("opentelemetry.exporter").warning("export failed: %s", "UNAVAILABLE")
        log.info("outside")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    inside, library, outside = lines
    context = span.get_span_context()
    assert inside["event"] == "inside" and inside["request_id"] == "r1" and inside["step_id"] == 3
    assert (inside["trace_id"], inside["span_id"]) == (
        format(context.trace_id, "032x"),
        format(context.span_id, "016x"),
    )
    assert library["event"] == "export failed: UNAVAILABLE" and library["level"] == "warning"
    assert library["trace_id"] == inside["trace_id"] and library["request_id"] == "r1"
    assert "trace_id" not in outside and outside["step_id"] == 3


def test_serve_passes_the_observability_flags_to_both_services():
    config = parse_args(
        "serve --otlp-endpoint http://localhost:4317 --trace-sample-ratio 0.1 --metrics-port 9100 --log-format json".split()
    ).config
    executor, scheduler = executor_command(config), scheduler_command(config)
    for command, port in ((executor, "9101"), (scheduler, "9100")):
        assert command[command.index("--otlp-endpoint") + 1] == "http://localhost:4317"
        assert command[command.index("--trace-sample-ratio") + 1] == "0.1"
        assert command[command.index("--metrics-port") + 1] == port
        assert command[command.index("--log-format") + 1] == "json"
    plain = ServeConfig()
    assert not {"--otlp-endpoint", "--trace-sample-ratio", "--metrics-port"} & set(
        executor_command(plain) + scheduler_command(plain)
    )
    for bad in ({"metrics_port": 65535}, {"metrics_port": 0}):
        with pytest.raises(ValueError):
            ServeConfig(**bad)
    executor_parser().parse_args(executor[3:])  # what serve passes, each service accepts
    scheduler_parser().parse_args(scheduler[3:])


def test_health_probe_exit_codes(capsys):
    assert health_probe([]) == 2
    assert health_probe([f"127.0.0.1:{free_port()}"]) == 1  # nothing listens
    assert "UNAVAILABLE" in capsys.readouterr().err

"""`serve` flags are generated from the settings classes: every default written once, old names
kept, env twins."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from agent_monitor import Policy
from agent_monitor.cli import main
from agent_monitor.cli._flags import build
from agent_monitor.cli._main import SERVE_CONFIG, BrokerOptions, JudgeOptions, ServeOptions, _parser
from agent_monitor.daemon import (
    BoardSettings,
    ClusterSettings,
    MetricsSettings,
    MonitorConfig,
    OtlpReceiverSettings,
    PhoenixSettings,
    RewardApiSettings,
    RunLimits,
)
from agent_monitor.daemon._config import WorkLimits

# Every flag `serve` had before the flags were generated: users' scripts use these names.
OLD_FLAGS = [
    "--broker",
    "--broker-username",
    "--broker-password",
    "--tls-ca",
    "--tls-cert",
    "--tls-key",
    "--topic-prefix",
    "--client-id",
    "--mqtt-protocol",
    "--session-expiry",
    "--embedded-broker",
    "--judge",
    "--judge-url",
    "--judge-model",
    "--judge-api",
    "--judge-timeout",
    "--max-concurrency",
    "--repeats",
    "--min-mass",
    "--abort-below",
    "--resample-below",
    "--min-steps",
    "--patience",
    "--regression",
    "--max-uncertainty",
    "--state-dir",
    "--no-store",
    "--allow-image-dir",
    "--allow-image-host",
    "--rescore",
    "--retention",
    "--hold",
    "--idle-timeout",
    "--max-runs",
    "--metrics-port",
    "--metrics-host",
    "--metric-labels",
    "--max-series",
    "--metrics-grace",
    "--log-level",
]
OLD_ENV = [
    f"AGENT_MONITOR_{f[2:].upper().replace('-', '_')}" for f in OLD_FLAGS if f not in ("--rescore",)
]
OLD_ENV = [
    e.replace("ALLOW_IMAGE_DIR", "ALLOW_IMAGE_DIRS").replace(
        "ALLOW_IMAGE_HOST", "ALLOW_IMAGE_HOSTS"
    )
    for e in OLD_ENV
]


def serve_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    parser = _parser(environ or {})
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    return serve_parser(environ).parse_args(argv)


def test_every_old_flag_and_environment_twin_is_still_there() -> None:
    text = serve_parser().format_help()
    missing = [f for f in OLD_FLAGS if f"{f} " not in text and f"{f}\n" not in text]
    assert missing == []
    assert [e for e in OLD_ENV if f"[{e}]" not in text] == []


def leaves(cls: type, default: object) -> list[tuple[str, object]]:
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(default, f.name)
        if f.metadata.get("cli") is False:
            continue
        if dataclasses.is_dataclass(value):
            out += leaves(type(value), value)
        else:
            out.append((f.name, value))
    return out


def test_no_flag_means_the_library_default_everywhere() -> None:
    args = parse([])
    # but the metrics port: serve binds 9464, a Monitor built in Python none
    assert (
        build(MonitorConfig, args)
        == SERVE_CONFIG
        == dataclasses.replace(MonitorConfig(), metrics_port=9464)
    )
    assert build(JudgeOptions, args) == JudgeOptions()
    assert build(BrokerOptions, args) == BrokerOptions()
    assert build(ServeOptions, args) == ServeOptions()


def test_help_shows_each_setting_with_its_default_and_environment_twin() -> None:
    text = " ".join(serve_parser().format_help().split())
    for cls, default in ((MonitorConfig, MonitorConfig()), (ServeOptions, ServeOptions())):
        for name, _ in leaves(cls, default):
            # Each field's help text is on the page (written once, on the field).
            f = next(
                f
                for c in (
                    cls,
                    Policy,
                    RunLimits,
                    MetricsSettings,
                    BoardSettings,
                    ClusterSettings,
                    OtlpReceiverSettings,
                    RewardApiSettings,
                    PhoenixSettings,
                    WorkLimits,
                )
                for f in dataclasses.fields(c)
                if f.name == name
            )
            first_words = " ".join(str(f.metadata["help"]).split()[:4])
            assert first_words in text, name
    assert (
        "--hold SECONDS seconds a step waits for its run's start, or for missing earlier "
        "steps (default: 10) [AGENT_MONITOR_HOLD]" in text
    )
    assert "(default: 0.35) [AGENT_MONITOR_MAX_UNCERTAINTY]" in text


def test_flags_and_environment_build_the_config() -> None:
    env = {
        "AGENT_MONITOR_ABORT_BELOW": "0.2",
        "AGENT_MONITOR_HOLD": "3",
        "AGENT_MONITOR_ALLOW_IMAGE_DIRS": os.pathsep.join(["/a", "/b"]),
    }
    args = parse(
        [
            "--max-runs",
            "5",
            "--metric-labels",
            "group, team",
            "--allow-image-host",
            "cams.local",
            "--patience",
            "4",
            "--rescore",
        ],
        env,
    )
    c = build(MonitorConfig, args)
    assert c.policy == Policy(abort_below=0.2, patience=4)
    assert c.limits == RunLimits(hold_s=3.0, max_runs=5)
    assert c.metrics.labels == ("group", "team")
    assert c.image_dirs == ("/a", "/b") and c.image_hosts == ("cams.local",)
    assert c.rescore is True
    # A flag beats its environment twin; an empty twin of an optional number means "none".
    assert build(MonitorConfig, parse(["--abort-below", "0.1"], env)).policy.abort_below == 0.1
    assert (
        build(MonitorConfig, parse([], {"AGENT_MONITOR_ABORT_BELOW": ""})).policy.abort_below
        is None
    )


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"AGENT_MONITOR_MAX_RUNS": "many"}, "AGENT_MONITOR_MAX_RUNS='many' is not an integer"),
        ({"AGENT_MONITOR_NO_STORE": "maybe"}, "AGENT_MONITOR_NO_STORE='maybe' is not a boolean"),
        (
            {"AGENT_MONITOR_MQTT_PROTOCOL": "4"},
            "AGENT_MONITOR_MQTT_PROTOCOL='4': use one of auto, 5, 3.1.1",
        ),
    ],
)
def test_a_bad_environment_value_is_one_line_and_exit_code_2(
    environ: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--judge", "openai"], environ) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_bad_setting_is_refused_by_the_class_that_owns_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(
            ["serve", "--judge", "openai", "--max-runs", "0", "--metrics-port", "0", "--no-store"],
            {},
        )
        == 2
    )
    assert "run limits {'max_runs': 0} must be >= 1" in capsys.readouterr().err


# -- the command line around the flags: help, version, no command --


def commands(environ: dict[str, str] | None = None) -> dict[str, argparse.ArgumentParser]:
    parser = _parser(environ or {})
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_argument_of_every_command_has_help_and_every_command_a_description() -> None:
    parsers = {"agent-monitor": _parser({}), **commands()}
    missing = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for name, p in parsers.items()
        for a in p._actions
        if not (a.help or "").strip()
    ]
    assert missing == []
    for name, p in commands().items():
        text = p.format_help()
        summary = str(p.description).split(".")[0]
        assert summary and summary.lower() in " ".join(_parser({}).format_help().split()).lower(), (
            name
        )
        assert text.split("\n\n")[1].startswith(summary[:40]), name  # right under the usage lines


def test_help_shows_the_default_of_every_option_that_has_one() -> None:
    lacking = []
    for name, p in commands().items():
        formatter = p._get_formatter()
        for a in p._actions:
            shows = "(default: " in str(formatter._get_help_string(a))
            if a.option_strings and a.nargs != 0 and a.default is not None and not shows:
                lacking.append(f"{name} {a.option_strings[-1]}")
    assert lacking == []
    replay = " ".join(commands()["replay"].format_help().split())
    assert (
        "--speed X time scale: 10 replays ten times faster than recorded (robot data: 0 "
        "sends as fast as frames "
        "decode) (default: 1)"
    ) in replay
    assert "--max-steps N publish at most this many steps per run (default: all)" in replay
    runs = " ".join(commands()["runs"].format_help().split())
    assert "--limit N at most this many runs, newest first (default: 50)" in runs


def test_version_and_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    from agent_monitor import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"], {})
    assert done.value.code == 0 and capsys.readouterr().out == f"agent-monitor {__version__}\n"
    # No command: the whole help (every command and how to get its flags), as a usage error.
    assert main([], {}) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: agent-monitor [-h] [--version] COMMAND ...")
    assert all(f"\n    {c} " in err for c in commands())
    assert "`agent-monitor COMMAND --help`" in " ".join(err.split())


@pytest.mark.parametrize("command", ["score", "serve", "eval", "demo"])
def test_every_judge_flag_has_its_environment_twin_wherever_it_is(command: str) -> None:
    text = commands()[command].format_help()
    for twin in ("JUDGE", "JUDGE_URL", "JUDGE_MODEL", "JUDGE_API", "JUDGE_TIMEOUT"):
        assert f"[AGENT_MONITOR_{twin}]" in text
    env = {"AGENT_MONITOR_JUDGE": "openai", "AGENT_MONITOR_JUDGE_TIMEOUT": "7.5"}
    argv = [] if command in ("serve", "demo") else ["runs/"]
    args = commands(env)[command].parse_args(argv)
    assert build(JudgeOptions, args) == JudgeOptions(judge="openai", judge_timeout=7.5)


def test_metrics_port_0_means_off_for_serve_and_demo_alike() -> None:
    for command in ("serve", "demo"):
        text = " ".join(commands()[command].format_help().split())
        assert (
            "--metrics-port N Prometheus /metrics port, 0 to disable (default: 9464) "
            "[AGENT_MONITOR_METRICS_PORT]" in text
        )
        assert (
            commands({"AGENT_MONITOR_METRICS_PORT": "0"})[command].parse_args([]).metrics_port == 0
        )


def test_abort_below_takes_a_number_or_auto_and_says_so_when_it_is_neither(
    capsys: pytest.CaptureFixture[str],
) -> None:
    c = build(
        MonitorConfig,
        parse(["--abort-below", "auto", "--alpha", "0.1", "--calibration-success-at", "0.8"]),
    )
    assert c.policy == Policy(abort_below="auto", alpha=0.1) and c.calibration_success_at == 0.8
    assert (
        build(MonitorConfig, parse([], {"AGENT_MONITOR_ABORT_BELOW": "AUTO"})).policy.abort_below
        == "auto"
    )
    assert build(MonitorConfig, parse(["--abort-below", "0.25"])).policy.abort_below == 0.25
    assert (
        build(
            MonitorConfig, parse(["--abort-below", "none"], {"AGENT_MONITOR_ABORT_BELOW": "auto"})
        ).policy.auto
        is False
    )
    text = " ".join(serve_parser().format_help().split())
    assert (
        "--abort-below X|auto abort when the score stays below this; 'auto': the "
        "calibrated threshold"
    ) in text

    with pytest.raises(SystemExit) as done:
        parse(["--abort-below", "automatic"])
    assert done.value.code == 2
    assert (
        "argument --abort-below: 'automatic' is not a number, auto or none"
        in capsys.readouterr().err
    )
    assert main(["serve", "--judge", "openai"], {"AGENT_MONITOR_ABORT_BELOW": "sometimes"}) == 2
    assert (
        "AGENT_MONITOR_ABORT_BELOW='sometimes' is not a number or auto" in capsys.readouterr().err
    )
    # In range is the policy's to say.
    assert (
        main(
            [
                "serve",
                "--judge",
                "openai",
                "--abort-below",
                "1.5",
                "--metrics-port",
                "0",
                "--no-store",
            ],
            {},
        )
        == 2
    )
    assert 'policy abort_below=1.5: use a number in [0, 1], or "auto"' in capsys.readouterr().err


def test_eval_refers_abort_below_auto_to_calibrate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "runs/", "--judge", "openai", "--abort-below", "auto"], {}) == 2
    assert (
        "eval --abort-below auto: a threshold learnt online needs eval --calibrate"
        in capsys.readouterr().err
    )

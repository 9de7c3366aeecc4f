"""The public surface, locked: what each package exports, what `import agent_monitor` loads, and who
imports what.

A change to a list below is a change to the public API: make it on purpose (and say so in the
notes).
"""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

PUBLIC = {
    "agent_monitor": [
        "AsyncGroupTracker",
        "AsyncProgressTracker",
        "BaseJudge",
        "Calibration",
        "CalibrationError",
        "Comparison",
        "CriteriaError",
        "Criterion",
        "CriterionScore",
        "Decision",
        "Family",
        "Frame",
        "FrameBudget",
        "GeminiJudge",
        "GroupTracker",
        "ImageError",
        "Judge",
        "JudgeError",
        "JudgeRequest",
        "JudgeResponse",
        "LETTERS",
        "LetterDistribution",
        "LlamaCppJudge",
        "Monitor",
        "MonitorClient",
        "MonitorConfig",
        "OpenAIJudge",
        "Policy",
        "PolicyError",
        "Prices",
        "Progress",
        "ProgressTracker",
        "Prompt",
        "Rubric",
        "RuleInput",
        "RuleScore",
        "ScoreError",
        "Selection",
        "Signal",
        "Step",
        "Threshold",
        "Tournament",
        "TrackerOptions",
        "Usage",
        "__version__",
        "aselect",
        "atrack",
        "build_prompt",
        "bundled_criteria",
        "compare",
        "distribution",
        "load_criteria",
        "load_image",
        "read_letter",
        "register_extractor",
        "register_rule",
        "score_prefix",
        "select",
        "tournament",
        "track",
    ],
    "agent_monitor.wire": [
        "BrokerSettings",
        "CriterionOut",
        "DEFAULT_BROKER",
        "DecisionOut",
        "Decoder",
        "ErrorOut",
        "EventError",
        "INPUT_KINDS",
        "ImageArg",
        "ImageIn",
        "InputEvent",
        "MAX_IMAGES",
        "MAX_IMAGE_BYTES",
        "MAX_LABELS",
        "MAX_LABEL_KEY_CHARS",
        "MAX_LABEL_VALUE_CHARS",
        "MAX_META_BYTES",
        "MAX_META_DEPTH",
        "MAX_PAYLOAD_BYTES",
        "MAX_RUN_ID_CHARS",
        "MAX_STEP_CHARS",
        "MAX_STEP_INDEX",
        "MAX_TASK_CHARS",
        "MonitorClient",
        "OUTPUT_KINDS",
        "POLICY_KEYS",
        "ProgressOut",
        "RankedRunOut",
        "RankingOut",
        "Run",
        "RunEnd",
        "RunStart",
        "SettingsError",
        "SignalName",
        "SignalOut",
        "StateOut",
        "StepIn",
        "Tokens",
        "TopicError",
        "Topics",
        "Totals",
        "UniformOut",
        "check_run_id",
        "decode_event",
        "errors_topic",
        "input_filters",
        "parse_topic",
        "ranking_topic",
        "schemas",
        "signal_json",
        "stale_schemas",
        "summarise",
        "topic",
        "write_schemas",
    ],
    "agent_monitor.daemon": [
        "DEFAULT_GC_THRESHOLD",
        "Accepted",
        "Board",
        "BoardSettings",
        "BrokerStartError",
        "BrokerUnavailable",
        "Duplicated",
        "EmbeddedBroker",
        "ClusterJournal",
        "ClusterSettings",
        "ClusterUnavailable",
        "HistoryQuery",
        "HttpRequest",
        "HttpResponse",
        "HttpServer",
        "Inbound",
        "Ingest",
        "JudgeServer",
        "JudgeServerSettings",
        "MemoryStore",
        "MetricsSettings",
        "Monitor",
        "MonitorConfig",
        "MonitorEvent",
        "OtlpReceiver",
        "OtlpReceiverSettings",
        "PhoenixSettings",
        "PhoenixSink",
        "PhoenixStatistics",
        "Protocol",
        "ProxySettings",
        "ProxySource",
        "Refused",
        "Replay",
        "RewardApiSettings",
        "RewardShape",
        "RewardSource",
        "Route",
        "RunClosed",
        "RunLimits",
        "RunOpened",
        "RunPages",
        "RunStore",
        "RunView",
        "RunsView",
        "Scored",
        "SignalChanged",
        "Sink",
        "Skipped",
        "Source",
        "SqliteStore",
        "StepView",
        "StoreFormatError",
        "default_state_dir",
        "tune_gc",
    ],
    "agent_monitor.testing": [
        "Answer",
        "FakeJudge",
        "ReplayJudge",
        "letter_at",
        "prompt_key",
        "record_answer",
        "save_answers",
    ],
    "agent_monitor.verifiers": [
        "CompositeVerifier",
        "ContainsVerifier",
        "EXTRACTOR_REGISTRY",
        "ExactMatchVerifier",
        "Extractor",
        "GeminiVerifier",
        "MCQExtractor",
        "MCQMatchVerifier",
        "NumberExtractor",
        "NumericToleranceVerifier",
        "OpenAIVerifier",
        "RegexExtractor",
        "StripExtractor",
        "StripReasoningExtractor",
        "VERIFIER_REGISTRY",
        "VerificationPipeline",
        "Verifier",
        "VerifyResult",
        "build_verification_pipeline",
    ],
    "agent_monitor.options": [
        "DEFAULT_ALLOW_FILES",
        "DEFAULT_CURVE_WINDOW",
        "DEFAULT_EXTRACT_BUDGET_S",
        "DEFAULT_MAX_SIDE",
        "DEFAULT_REPEATS",
        "OPTION_NAMES",
        "ProgressCallback",
        "ScoringOptions",
        "TrackerOptions",
    ],
    "agent_monitor.cli": ["main"],
    "agent_monitor.integrations": [
        "DEFAULT_MAX_CHARS",
        "DEFAULT_MAX_STEPS",
        "RewardUnavailable",
        "StopKind",
        "Verdict",
        "split_turns",
        "verdict",
    ],
    "agent_monitor.integrations.verl": ["ComputeScore", "RewardForm", "make_compute_score"],
    "agent_monitor.integrations.verifiers": [
        "DEFAULT_MAX_ROLLOUTS",
        "DEFAULT_MAX_STEP_CHARS",
        "INFO_KEY",
        "MonitorHooks",
        "monitor_hooks",
    ],
    "agent_monitor.integrations.ray": ["DEFAULT_MAX_RUNS", "MonitorActor", "MonitorService"],
    "agent_monitor.robotdata": [
        "DEFAULT_MAX_STEPS",
        "Episode",
        "EpisodeStep",
        "LeRobotDataset",
        "McapBag",
        "ReadOptions",
        "ReplayStats",
        "RobotDataError",
        "StartRun",
        "StepSink",
        "TrackerSink",
        "VideoCursor",
        "episode_run_id",
        "is_lerobot",
        "is_mcap",
        "is_robot_data",
        "prefetch",
        "read_episodes",
        "replay_episodes",
    ],
}

# The packages around the concepts keep their modules private: their public face is their __all__.
PACKAGES = (
    "agent_monitor.wire",
    "agent_monitor.daemon",
    "agent_monitor.cli",
    "agent_monitor.robotdata",
)


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_all_is_locked_and_every_name_resolves(module: str) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(PUBLIC[module]), f"{module}.__all__ changed"
    for name in mod.__all__:
        assert getattr(mod, name) is not None


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_have_no_public_modules(package: str) -> None:
    # Subpackages (the daemon's parts: sources, runs, sinks, ...) are folders, not API: their
    # modules are private too, and each exports its face in __all__ for the other parts.
    mod = importlib.import_module(package)
    public = [
        f"{prefix}{m.name}"
        for prefix, path in _packages_under(package, mod.__path__)
        for m in pkgutil.iter_modules(path)
        if not m.ispkg and not m.name.startswith("_")
    ]
    assert public == [], (
        f"{package} has public modules {public}; make them private and export names in __all__"
    )


def _packages_under(name: str, path: list[str]) -> list[tuple[str, list[str]]]:
    found = [("", path)]
    for m in pkgutil.iter_modules(path):
        if m.ispkg and not m.name.startswith("_"):
            sub = importlib.import_module(f"{name}.{m.name}")
            assert hasattr(sub, "__all__"), (
                f"{name}.{m.name} exports no __all__: list its face there"
            )
            found += [
                (f"{m.name}.{p}", q)
                for p, q in _packages_under(f"{name}.{m.name}", list(sub.__path__))
            ]
    return found


def test_import_agent_monitor_loads_no_daemon_wire_or_mqtt_module() -> None:
    code = (
        "import json, sys, agent_monitor\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('aiomqtt', 'paho', 'prometheus_client', 'pydantic', 'sqlite3', 'amqtt') "
        "or m.startswith(('agent_monitor.daemon', 'agent_monitor.wire', 'agent_monitor.cli')))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert json.loads(out.stdout) == []


def test_the_trainer_integrations_load_no_framework() -> None:
    # Each is import-light: verifiers and ray are imported when a hook or an actor is made, never at
    # import.
    code = (
        "import json, sys\n"
        "import agent_monitor.integrations.verl, agent_monitor.integrations.verifiers, "
        "agent_monitor.integrations.ray\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('verifiers', "
        "'ray', 'verl', 'torch') "
        "or m.startswith(('agent_monitor.daemon', 'agent_monitor.wire', 'agent_monitor.cli')))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert json.loads(out.stdout) == []


def test_monitor_and_client_are_reachable_lazily_from_the_top() -> None:
    code = (
        "import sys, agent_monitor\n"
        "assert 'agent_monitor.daemon' not in sys.modules\n"
        "from agent_monitor.daemon import Monitor\n"
        "from agent_monitor.wire import MonitorClient\n"
        "assert agent_monitor.Monitor is Monitor and agent_monitor.MonitorClient is MonitorClient\n"
        "assert agent_monitor.MonitorConfig.__module__ == 'agent_monitor.daemon._config'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def _agent_monitor_imports(path: Path) -> list[tuple[str, list[str], int]]:
    """Every `from agent_monitor... import names` and `import agent_monitor...` in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "agent_monitor"
        ):
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [
                (a.name, [], node.lineno)
                for a in node.names
                if a.name.split(".")[0] == "agent_monitor"
            ]
    return out


@pytest.mark.parametrize("folder", ["adapters", "bench"])
def test_adapters_and_benchmarks_use_only_public_names(folder: str) -> None:
    bad = []
    for path in sorted((REPO / folder).glob("*.py")):
        for module, names, line in _agent_monitor_imports(path):
            if module.startswith("agent_monitor.adapters"):
                continue  # the adapters' own package name in the wheel
            where = f"{path.relative_to(REPO)}:{line}"
            if any(part.startswith("_") for part in module.split(".")):
                bad.append(f"{where} imports the private module {module}")
                continue
            mod = importlib.import_module(module)
            exported = getattr(mod, "__all__", None)
            for name in names:
                if name.startswith("_") or (exported is not None and name not in exported):
                    bad.append(f"{where} imports {name} from {module}, which does not export it")
    assert bad == []

"""Per-sample verification pipelines in lmms-eval's shape: raw output -> extractors -> verifier ->
`VerifyResult`.

`agent_monitor.verifiers` stands in for `lmms_eval.verifiers` with the same names:
`VerificationPipeline`, `build_verification_pipeline`, `VerifyResult`, the `extractors`, `rule`,
`composite`, `base`, `openai` and `gemini` submodules, `VERIFIER_REGISTRY` and `EXTRACTOR_REGISTRY`.
The LLM verifiers use agent-monitor's judges and read the expectation over the letter logprobs; a
failed judge call is `metadata["judge_failed"]`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import Extractor, Verifier, VerifyResult
from .composite import CompositeVerifier
from .extractors import (
    MCQExtractor,
    NumberExtractor,
    RegexExtractor,
    StripExtractor,
    StripReasoningExtractor,
)
from .gemini import GeminiVerifier
from .openai import OpenAIVerifier
from .rule import ContainsVerifier, ExactMatchVerifier, MCQMatchVerifier, NumericToleranceVerifier

EXTRACTOR_REGISTRY: dict[str, type[Extractor]] = {
    "strip_reasoning": StripReasoningExtractor,
    "regex": RegexExtractor,
    "mcq": MCQExtractor,
    "number": NumberExtractor,
    "strip": StripExtractor,
}
"""Extractor classes by config `type`; add your own to use it in `build_verification_pipeline`."""

VERIFIER_REGISTRY: dict[str, type[Verifier]] = {
    "exact_match": ExactMatchVerifier,
    "contains": ContainsVerifier,
    "mcq_match": MCQMatchVerifier,
    "numeric": NumericToleranceVerifier,
    "openai": OpenAIVerifier,
    "gemini": GeminiVerifier,
    "composite": CompositeVerifier,
}
"""Verifier classes by config `type` (`composite` takes a `verifiers` list of configs)."""

_PIPELINE_KEYS = ("extractors", "verifier")


class VerificationPipeline:
    """`pipeline(question, prediction, ground_truth) -> VerifyResult`: the extractors in order,
    then the verifier."""

    def __init__(
        self, extractors: Sequence[Extractor] = (), verifier: Verifier | None = None
    ) -> None:
        if verifier is None:
            raise TypeError("VerificationPipeline needs verifier= (e.g. ExactMatchVerifier())")
        self.extractors = list(extractors)
        self.verifier = verifier

    def extract(self, prediction: str, **kwargs: Any) -> str:
        """The prediction after every extractor."""
        text = "" if prediction is None else str(prediction)
        for e in self.extractors:
            text = e.extract(text, **kwargs)
        return text

    def __call__(
        self, question: str, prediction: str, ground_truth: str, **kwargs: Any
    ) -> VerifyResult:
        extracted = self.extract(prediction, **kwargs)
        result = self.verifier.verify(question, extracted, str(ground_truth), **kwargs)
        result.metadata.setdefault("extracted", extracted)
        return result


def _build(kind: str, registry: Mapping[str, type[Any]], spec: object, where: str) -> Any:
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ValueError(
            f"{where}: give a dict with a 'type' ({', '.join(registry)}), not {spec!r}"
        )
    params = {k: v for k, v in spec.items() if k != "type"}
    cls = registry.get(str(spec["type"]))
    if cls is None:
        raise ValueError(
            f"{where}: unknown {kind} type {spec['type']!r}; use one of {', '.join(registry)}"
        )
    if cls is CompositeVerifier:
        members = params.pop("verifiers", None)
        if params:
            raise ValueError(
                f"{where}: composite takes only 'verifiers', not {', '.join(map(repr, params))}"
            )
        if not isinstance(members, list) or not members:
            raise ValueError(
                f"{where}: composite needs a non-empty 'verifiers' list of verifier configs"
            )
        return CompositeVerifier(
            [_build(kind, registry, m, f"{where}.verifiers[{i}]") for i, m in enumerate(members)]
        )
    try:
        return cls(**params)
    except TypeError as e:
        raise ValueError(f"{where} ({spec['type']}): {e}") from None


def build_verification_pipeline(config: Mapping[str, Any]) -> VerificationPipeline:
    """A pipeline from the guide's config: `{"extractors": [{"type": ...}, ...], "verifier":
    {"type": ..., ...}}`.

    Every key is read or refused by name: an unknown top-level key, type or parameter is a
    ValueError.
    """
    if not isinstance(config, Mapping):
        raise ValueError(
            "a pipeline config is a dict with 'extractors' and 'verifier', not "
            f"{type(config).__name__}"
        )
    unknown = [k for k in config if k not in _PIPELINE_KEYS]
    if unknown:
        raise ValueError(
            f"pipeline config: unknown key(s) {', '.join(map(repr, unknown))}; use "
            "'extractors', 'verifier'"
        )
    raw = config.get("extractors") or []
    if not isinstance(raw, list):
        raise ValueError("pipeline config: 'extractors' is a list of extractor configs")
    extractors = [
        _build("extractor", EXTRACTOR_REGISTRY, e, f"extractors[{i}]") for i, e in enumerate(raw)
    ]
    if "verifier" not in config:
        raise ValueError("pipeline config: 'verifier' is missing; e.g. {'type': 'exact_match'}")
    return VerificationPipeline(
        extractors, _build("verifier", VERIFIER_REGISTRY, config["verifier"], "verifier")
    )


__all__ = [
    "EXTRACTOR_REGISTRY",
    "VERIFIER_REGISTRY",
    "CompositeVerifier",
    "ContainsVerifier",
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
    "VerificationPipeline",
    "Verifier",
    "VerifyResult",
    "build_verification_pipeline",
]

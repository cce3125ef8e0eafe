"""Fill in the expected answers of the decision group with the reference implementation, once.

    python -m omnigraph.conformance.reference [--suite v1]

For every decision case whose `expect` carries a `reference` note, this asks the `laya` package
(the reference implementation; a test dependency, not needed to run the suite) the same request on
the synthetic tiny Laya checkpoint, seed 0 (`omnigraph.pipelines.laya.synth.cached_checkpoint`,
the checkpoint behind the embedded default bundle), on CPU in eager fp32, and writes its
`answers` and `usage` (input and output tokens) into the fixture, and the checkpoint's identity
into `setup.answers_for` (decision_group.py). A question whose two most
likely options are closer than twice the case's tolerance is refused: its winner would depend on
rounding, so the request must change instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from omnigraph.conformance.suite import SUITES_ROOT, load_group

USAGE_KEYS = ("input_tokens", "output_tokens")


class NearTie(ValueError):
    """A reference answer too close to a tie to be a stable expectation."""


def reference_note() -> str:
    import laya

    return f"laya {laya.__version__} (CPU, eager fp32) on the synthetic tiny Laya checkpoint, seed 0"


def fill_reference_answers(suite: str = "v1") -> int:
    """Rewrite the suite's decision.json with reference answers; returns how many cases were filled."""
    import laya

    from omnigraph.pipelines.laya.export import checkpoint_content_sha256
    from omnigraph.pipelines.laya.synth import cached_checkpoint

    path = SUITES_ROOT / suite / "decision.json"
    load_group(path)  # refuse a malformed fixture before touching it
    document = json.loads(path.read_text(encoding="utf-8"))
    checkpoint = cached_checkpoint("tiny", seed=0)
    agent = laya.load(str(checkpoint), device="cpu")
    note = reference_note()
    document["setup"]["answers_for"] = {  # what a runner compares the served model with first
        "model": "the synthetic tiny Laya checkpoint, seed 0 (the embedded default), fp32",
        "checkpoint_revision": checkpoint_content_sha256(checkpoint),
        "precision": "fp32",
    }
    filled = 0
    for case in document["cases"]:
        expect = case["expect"]
        if "reference" not in expect:
            continue
        request = case["send"]["json"]
        result = agent.system_one(request["state"], request["questions"])
        _refuse_near_ties(case["id"], result["answers"], expect["tolerance"])
        expect["answers"] = result["answers"]
        expect["usage"] = {key: result["usage"][key] for key in USAGE_KEYS}
        expect["reference"] = note
        filled += 1
    path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return filled


def _refuse_near_ties(case_id: str, answers: Mapping[str, Any], tolerance: float) -> None:
    for qid, answer in answers.items():
        probabilities = answer.get("probabilities")
        values = sorted(probabilities.values() if probabilities else (answer["noul"], 1 - answer["noul"]), reverse=True)
        if len(values) > 1 and values[0] - values[1] < 2 * tolerance:
            raise NearTie(f"{case_id}: question {qid!r} is a near tie ({values[0]} vs {values[1]}); change the request")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omnigraph.conformance.reference",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="v1")
    args = parser.parse_args(argv)
    filled = fill_reference_answers(args.suite)
    print(f"wrote reference answers for {filled} decision cases of suite {args.suite}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

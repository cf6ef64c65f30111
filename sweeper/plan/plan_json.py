"""`plan --json`'s text: the contract's array of ``PlanEntry.to_json`` elements, written as ``json.dumps`` would
write that list, byte for byte, without a dict per entry (issue 54: 200k entries, 158 MB, in a DeepSeek-V3 plan).

The layouts are encoded column by column (``layouts_json``); an invalid entry's rest, its reasons and the empty
prediction, is encoded once per distinct list of reasons (a space has a few hundred); only a valid entry's prediction
is encoded for itself. ``tests/plan/test_plan_json.py`` compares the text with ``json.dumps`` over whole spaces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from sweeper.plan.assess import NO_PREDICTION, PlanEntry
from sweeper.space.layout import layouts_json

_NO_PREDICTION_TEXT = json.dumps(NO_PREDICTION)


def plan_json(entries: Sequence[PlanEntry]) -> str:
    """``json.dumps([e.to_json() for e in entries], check_circular=False)``, faster."""
    verdicts: dict[tuple[str, ...], str] = {}  # by reasons: '"valid": ..., "reasons": [...]'
    texts = []
    for entry, layout in zip(entries, layouts_json([e.layout for e in entries]), strict=True):
        reasons = tuple(entry.reasons)
        verdict = verdicts.get(reasons)
        if verdict is None:
            verdict = verdicts[reasons] = f'"valid": {json.dumps(not reasons)}, "reasons": {json.dumps(reasons)}'
        predicted = (_NO_PREDICTION_TEXT if entry.predicted is None
                     else json.dumps(entry.predicted.to_json(), check_circular=False))
        texts.append(f'{{"layout": {layout}, {verdict}, "predicted": {predicted}}}')
    return "[" + ", ".join(texts) + "]"

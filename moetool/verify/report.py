"""What ``moetool verify`` reports: per layer the errors against the reference, the worst
expert, tokens per rank, timings and bytes moved (LayerReport); per run the options,
thresholds and layers, rendered as a table or JSON (VerifyReport)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moetool.errors import VerificationFailed


@dataclass
class LayerReport:
    layer: int
    rel_err: float
    sqnr_db: float
    max_abs_err: float
    tokens_per_rank: list[int]
    worst_expert: int
    worst_expert_rank: int
    worst_expert_rel_err: float
    passed: bool
    reason: str = ""
    timings_ms: dict = field(default_factory=dict)
    bytes_moved: dict = field(default_factory=dict)


@dataclass
class VerifyReport:
    shards: str
    reference: str
    format: str
    options: dict
    thresholds: dict
    layers: list[LayerReport]
    #: seconds of the run's parts: startup_s (this process's start to the spawn), ranks_s
    #: (spawn to the ranks' results), reference_s (the parent's reference, concurrent with the
    #: ranks), wall_s (both), rank_<step>_s (spawn to the last rank's end of start, loaded,
    #: forward, probed, checked)
    timings_s: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(l.passed for l in self.layers)

    def to_json(self) -> dict:
        return {"shards": self.shards, "reference": self.reference, "format": self.format, "passed": self.passed,
                "options": self.options, "thresholds": self.thresholds, "layers": [asdict(l) for l in self.layers],
                "timings_s": self.timings_s}

    def render(self) -> str:
        o = self.options
        head = (f"verify {self.shards} against {self.reference}: format {self.format}, ep {o['ep']}, dp {o['dp']}, "
                f"dispatch {o['dispatch']}{' (' + o['transport'] + ')' if o.get('transport') else ''}, experts {o['experts']}, {o['tokens']} tokens per dp group, backend {o['backend']}"
                + (f"\nnumerics {o['numerics_detail']}" if o.get("numerics_detail") else ""))
        cols = f"{'layer':>5}  {'rel err':>9}  {'SQNR dB':>8}  {'max abs':>9}  {'worst expert (rank)':>19}  {'exp err':>8}  {'ms/fwd':>7}  tokens per rank   result"
        lines = [head, cols]
        for l in self.layers:
            ms = l.timings_ms.get("total", float("nan"))
            lines.append(
                f"{l.layer:>5}  {l.rel_err:>9.2e}  {l.sqnr_db:>8.1f}  {l.max_abs_err:>9.2e}  "
                f"{str(l.worst_expert) + ' (' + str(l.worst_expert_rank) + ')':>19}  {l.worst_expert_rel_err:>8.2e}  "
                f"{ms:>7.2f}  {str(l.tokens_per_rank):<16}  {'PASS' if l.passed else 'FAIL: ' + l.reason}")
        failed = [l.layer for l in self.layers if not l.passed]
        t = self.thresholds
        lines.append(
            f"{'PASSED' if not failed else 'FAILED'}: {len(self.layers) - len(failed)}/{len(self.layers)} layers within "
            f"rel err {t['rel_err']:g} (layer) / {t['expert_rel_err']:g} (each expert)"
            + (f"; failing layers {failed}" if failed else ""))
        return "\n".join(lines)


def save_json(report: VerifyReport, path: Path) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=2))


def raise_if_failed(report: VerifyReport) -> None:
    if not report.passed:
        bad = [f"layer {l.layer}: {l.reason}" for l in report.layers if not l.passed]
        raise VerificationFailed("verification failed: " + "; ".join(bad))

"""Per-generation statistics: target forwards, tau, acceptance per depth, wall-time split.

tau (accept length) follows the vLLM/SGLang convention: tokens committed per verification forward,
i.e. 1 + accepted draft tokens, averaged over decode steps (the prefill forward is not counted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def acceptance_rates(attempts: Sequence[int], accepts: Sequence[int]) -> list[float]:
    """Acceptance rate per draft depth, up to the deepest depth any draft reached with its parent accepted
    (deeper depths were never tried, so they have no rate rather than 0%)."""
    rates = [a / t if t else 0.0 for t, a in zip(attempts, accepts)]
    reached = max((d + 1 for d, t in enumerate(attempts) if t), default=0)
    return rates[:reached]


@dataclass
class GenerationStats:
    new_tokens: int = 0
    """Tokens generated (first token from the prefill included)."""
    steps: int = 0
    """Verification forwards after the prefill."""
    accepted: int = 0
    """Draft tokens accepted over all steps."""
    depth_attempts: list[int] = field(default_factory=list)
    """depth_attempts[d-1]: steps whose draft reached depth d with depths 1..d-1 accepted."""
    depth_accepts: list[int] = field(default_factory=list)
    """depth_accepts[d-1]: steps that accepted at least d draft tokens."""
    accept_lengths: list[int] = field(default_factory=list)
    """1 + accepted, per step (the histogram behind tau)."""
    draft_steps: int = 0
    """Steps that verified a draft (a tree beyond the root); the rest were plain decoding steps."""
    reused_tokens: int = 0
    """Prompt tokens whose KV came from a prefix cache (not prefilled again)."""
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    def record_step(self, draft_depth: int, num_accepted: int, draft_s: float, verify_s: float) -> None:
        self.steps += 1
        self.draft_steps += int(draft_depth > 0)
        self.accepted += num_accepted
        self.accept_lengths.append(1 + num_accepted)
        grow = draft_depth - len(self.depth_attempts)
        if grow > 0:
            self.depth_attempts.extend([0] * grow)
            self.depth_accepts.extend([0] * grow)
        for d in range(min(draft_depth, num_accepted + 1)):
            self.depth_attempts[d] += 1
            self.depth_accepts[d] += int(num_accepted > d)
        self.draft_s += draft_s
        self.verify_s += verify_s

    @property
    def tau(self) -> float:
        """Mean tokens per verification forward (1.0 for plain decoding)."""
        return (self.steps + self.accepted) / self.steps if self.steps else 1.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """P(accept depth d | draft reached d and depth d-1 was accepted), up to the deepest depth reached."""
        return acceptance_rates(self.depth_attempts, self.depth_accepts)

    @property
    def other_s(self) -> float:
        """Wall time outside the draft and target forwards (acceptance, bookkeeping, Python)."""
        return max(0.0, self.wall_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, acceptance_by_depth=self.acceptance_by_depth, other_s=self.other_s,
                 tokens_per_s=self.tokens_per_s)
        return d

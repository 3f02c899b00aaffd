"""The online speculation gate: draft only while drafting commits tokens faster than plain decoding.

Whether speculation pays depends on the machine as much as on the drafter: verifying n tree nodes
costs about one token's forward where the forward is memory-bound (a GPU, a CPU with native bf16
GEMM at batch 1), but close to n forwards where it is compute-bound (many batch rows, or bf16 weights
on a CPU without bf16 instructions, where PyTorch's bf16 GEMM costs about m times a one-row product).
The gate measures both modes on the run itself and keeps the faster, so a drafter that cannot pay
on this machine costs a probe step now and then instead of a slowdown. Used by the batch-1 loop
(:func:`selfdraft.generate.generate`, ``GenerationConfig.auto_off``) and the batched loop
(:func:`selfdraft.batch.generate_batch`, ``TreePolicy.auto_off``).
"""

from __future__ import annotations


class SpeculationGate:
    """Online on/off switch for speculation, per batch size (the number of rows in a step).

    For each batch size it keeps exponential moving averages of the tokens committed per step and of
    the step time (draft + verify + accept), for speculative and for plain steps; their ratio is the
    mode's rate (a ratio of averages, not an average of per-step rates, which would overrate a
    drafter whose steps alternate between long accepts and rejections). The first steps at a size
    measure both modes; then the faster one runs, and every ``probe_every``-th step runs the other
    once so that a change (longer contexts, a drafter warming up) is seen. A probe that confirms
    the loser doubles the interval to the next (up to ``max_backoff`` times ``probe_every``), since
    a probe of a mode that loses on this machine costs a slow step each time; a probe that swaps the
    modes resets it. Greedy output does not depend on the gate; only speed does.
    """

    def __init__(self, probe_every: int = 16, decay: float = 0.8, max_backoff: int = 8):
        self.probe_every, self.decay, self.max_backoff = probe_every, decay, max_backoff
        self.sums: dict[tuple[int, bool], tuple[float, float]] = {}
        """(rows, speculative) -> EMAs of (tokens per step, seconds per step)."""
        self.steps: dict[int, int] = {}
        self.interval: dict[int, int] = {}
        """rows -> steps between probes now (probe_every, doubled by each confirming probe)."""
        self.last_probe: dict[int, int] = {}
        self.probing: dict[int, bool] = {}
        """rows -> which mode was winning when the probe now running started."""

    def rate(self, rows: int, speculative: bool) -> float | None:
        """Measured tokens per second of one mode at one batch size (None: not measured yet)."""
        sums = self.sums.get((rows, speculative))
        return None if sums is None else sums[0] / max(sums[1], 1e-9)

    def speculate(self, rows: int) -> bool:
        """Whether the next step with ``rows`` rows should draft."""
        n = self.steps.get(rows, 0)
        self.steps[rows] = n + 1
        spec, plain = self.rate(rows, True), self.rate(rows, False)
        if spec is None or plain is None:
            return spec is None
        best = spec >= plain
        if n + 1 - self.last_probe.get(rows, 0) < self.interval.get(rows, self.probe_every):
            return best
        self.last_probe[rows] = n + 1
        self.probing[rows] = best
        return not best

    def record(self, rows: int, speculative: bool, tokens: int, seconds: float) -> None:
        """One step's outcome: ``tokens`` committed over all rows in ``seconds``."""
        old = self.sums.get((rows, speculative))
        if old is None:
            self.sums[(rows, speculative)] = (float(tokens), seconds)
        else:
            d = self.decay
            self.sums[(rows, speculative)] = (d * old[0] + (1 - d) * tokens, d * old[1] + (1 - d) * seconds)
        was_best = self.probing.pop(rows, None)
        if was_best is not None and speculative == was_best:
            # the probe did not run the other mode (a drafter with nothing to propose drafts no tree):
            # it says nothing about the loser, so probe again at the next step
            self.last_probe[rows] = self.steps[rows] - self.interval.get(rows, self.probe_every)
            return
        spec, plain = self.rate(rows, True), self.rate(rows, False)
        if was_best is not None and spec is not None and plain is not None:
            interval = self.interval.get(rows, self.probe_every)
            confirmed = (spec >= plain) == was_best
            self.interval[rows] = min(2 * interval, self.max_backoff * self.probe_every) if confirmed else self.probe_every

    def speeds(self) -> dict[int, tuple[float | None, float | None]]:
        """Batch size -> (speculative, plain) tokens per second measured so far."""
        return {r: (self.rate(r, True), self.rate(r, False)) for r in sorted(self.steps)}

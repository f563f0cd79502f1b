"""The sum of a round without secure aggregation's messages: what the fast simulator adds.

:class:`PlainSum` ends a round exactly as :class:`aggregator.secagg_server.SecAggServer`
would, without keys, shares or masks: it sums the survivors' residues in the same ring
(``edge_sdk.hazmat.ring``) and decides who survives, or why the round fails, by the same
rules (``edge_sdk.hazmat.graph.survivor_sets``: the t-core pruning of the two key stages,
the upload check, the share count of recovery) on the same neighbour graph. Masks cancel in
SecAgg+'s sum, so for a given cohort, graph, threshold and dropout pattern both give the
same survivors and the same total, or the same failure with the same words
(``tests/test_plain_sum.py`` checks it against real rounds).

Dropouts are given in advance, as the stage each vanishing device vanishes in
(:data:`STAGES`; ``tools.dropouts.DropoutSchedule`` draws them), so the survivors are known
before any value is summed: a caller computes and :meth:`PlainSum.add` s the values of
:attr:`PlainSum.survivors` only. Each stage names the message that opens it; a device that
vanishes in it answers nothing from then on:

* ``keys`` (on the plan): never advertises keys, so never masks or uploads;
* ``shares`` (on its neighbours' keys): advertised, never shares its keys;
* ``masked`` (on the forwarded shares): shared its keys, never uploads;
* ``unmask`` (on the unmask request): uploaded (it is in the sum if the round succeeds),
  never helps unmask.

The round machine's own rule (``RoundPolicy.min_survivors``) is not SecAgg+'s and is not
applied here: :attr:`PlainSum.answered` gives the counts it judges, and
``aggregator.round_core.short_of_survivors`` judges them as the round machine does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edge_sdk._validate import check_int as _check_int
from edge_sdk.errors import LocalProtocolError, RoundFailed
from edge_sdk.hazmat import graph as _graph
from edge_sdk.hazmat.ring import Ring
from edge_sdk.secagg import RoundConfig

__all__ = ["STAGES", "PlainSum"]

STAGES: tuple[str, ...] = ("keys", "shares", "masked", "unmask")
"""The stages a device can vanish in, in order (module docstring)."""


class PlainSum:
    """One round's sum of the survivors' residues, survivors decided as SecAgg+ decides them.

    Args:
        round_id: the round (named in the failure, as ``SecAggServer`` names it).
        cohort: the selected devices, distinct.
        graph: the SecAgg+ neighbour graph of the cohort ({device: its neighbours}, e.g.
            ``RoundConfig.graph()``); the complete graph for the original SecAgg.
        threshold: Shamir t, 1 <= t <= every device's degree.
        ring: the ring Z_{2^b} the values live in.
        length: how many values each survivor adds.
        vanished: {device: the stage of :data:`STAGES` it vanishes in}; a cohort member
            not in it answers every stage.

    Raises:
        ValueError: any argument not as described (named).
    """

    __slots__ = ("_added", "_answered", "_length", "_ring", "_round_id", "_sum", "_survivors")

    def __init__(
        self,
        *,
        round_id: int,
        cohort: Sequence[str],
        graph: _graph.Graph,
        threshold: int,
        ring: Ring,
        length: int,
        vanished: Mapping[str, str],
    ) -> None:
        self._round_id = _check_int("round_id", round_id, 0)
        members = tuple(cohort)
        if len(set(members)) != len(members):
            raise ValueError(f"cohort must be distinct, got {sorted(members)}")
        if set(graph) != set(members):
            raise ValueError(
                f"graph must have exactly the cohort's devices, got {sorted(graph)} for "
                f"{sorted(members)}"
            )
        degree = min((len(graph[u]) for u in members), default=1)
        t = _check_int("threshold", threshold, 1, max(degree, 1))
        if not isinstance(ring, Ring):
            raise ValueError(f"ring must be a Ring, got {type(ring).__name__}")
        n = _check_int("length", length, 1)
        outsiders = sorted(set(vanished) - set(members))
        if outsiders:
            raise ValueError(f"vanished names devices outside the cohort: {outsiders}")
        bad = {d: s for d, s in vanished.items() if s not in STAGES}
        if bad:
            raise ValueError(f"vanish stages must be among {STAGES}, got {bad}")

        def past(stage: str) -> list[str]:
            # the devices that did what ``stage`` asks: those that vanish later, or never
            at = STAGES.index(stage)
            return [u for u in members if u not in vanished or STAGES.index(vanished[u]) > at]

        self._survivors = _graph.survivor_sets(
            graph,
            t,
            advertised=past("keys"),
            shared=past("shares"),
            uploaded=past("masked"),
            answered=past("unmask"),
        )
        # how many answered each stage the round reached, as the round machine counts them
        # before closing it (the devices it still expected: the last stage's survivors)
        sv = self._survivors
        answered = [("collect_keys", len(past("keys")), len(members))]
        if sv.u1:
            answered.append(("collect_shares", sum(u in sv.u1 for u in past("shares")),
                             len(sv.u1)))
        if sv.u2:
            answered.append(("collect_masked", sum(u in sv.u2 for u in past("masked")),
                             len(sv.u2)))
        self._answered = tuple(answered)
        self._ring = ring
        self._length = n
        self._sum: np.ndarray | None = None  # in the dtype the ring keeps residues in
        self._added: set[str] = set()

    @classmethod
    def for_config(cls, config: RoundConfig, *, vanished: Mapping[str, str]) -> PlainSum:
        """The plain sum of the SecAgg+ round ``config`` describes (its cohort, neighbour
        graph, threshold, ring and length)."""
        if config.amortized:
            raise ValueError("config.amortized is True: the amortized variant's survivor "
                             "rules are not SecAgg+'s")
        return cls(
            round_id=config.round_id,
            cohort=config.cohort,
            graph=config.graph(),
            threshold=config.threshold,
            ring=Ring(bits=config.bits),
            length=config.length,
            vanished=vanished,
        )

    @property
    def failed(self) -> str | None:
        """Why the round fails (``SecAggServer``'s reason, word for word), or None."""
        return self._survivors.failed

    @property
    def answered(self) -> tuple[tuple[str, int, int], ...]:
        """(stage, how many devices answered it, how many it asked) for each collecting
        stage before the unmask stage that the round reaches (``ServerStage`` values, in
        order): what the round machine compares with ``min_survivors`` when it closes each
        of them (at its deadline when some did not answer)."""
        return self._answered

    @property
    def survivors(self) -> tuple[str, ...]:
        """U3, the devices whose values the total sums (sorted); empty when the round fails
        before recovery. The caller must :meth:`add` each of them, and no one else."""
        return tuple(sorted(self._survivors.u3))

    def add(self, device: str, values: np.ndarray) -> None:
        """Add one survivor's values to the sum.

        Args:
            device: one of :attr:`survivors`, not added before.
            values: 1-D integer residues in [0, 2^bits), exactly ``length`` of them
                (checked as ``SecAggClient.mask_input`` checks its input).

        Raises:
            ValueError: the device is not a survivor or was added before, or the values are
                not as described; nothing is added.
        """
        if device not in self._survivors.u3:
            raise ValueError(
                f"{device!r} is not a survivor of round {self._round_id} "
                f"(survivors: {list(self.survivors)})"
            )
        if device in self._added:
            raise ValueError(f"{device!r} was already added to round {self._round_id}")
        v = self._ring.check_residues(values, name=f"values of {device!r}")
        if v.size != self._length:
            raise ValueError(
                f"values of {device!r} must have {self._length} entries, got {v.size}"
            )
        # summed in the ring's storage dtype, as SecAggServer sums: it wraps mod 2^(8w), a
        # multiple of 2^b, so the sum reduced at the end is exact
        if self._sum is None:
            self._sum = v
        else:
            np.add(self._sum, v, out=self._sum)
        self._added.add(device)

    def total(self) -> np.ndarray:
        """The survivors' sum mod 2^bits, as ``SecAggServer.finalize`` returns it.

        Returns:
            ``length`` residues in the ring's storage dtype (``Ring.check_residues``').

        Raises:
            RoundFailed: the round fails (``round {id} failed: {why}``, as SecAggServer).
            LocalProtocolError: a survivor's values were not added yet.
        """
        if self._survivors.failed is not None:
            raise RoundFailed(f"round {self._round_id} failed: {self._survivors.failed}")
        missing = sorted(self._survivors.u3 - self._added)
        if missing:
            raise LocalProtocolError(f"total() before the values of survivors {missing}")
        # a round that did not fail has a survivor (graph.upload_problem), so a sum
        assert self._sum is not None
        return self._sum & self._sum.dtype.type(self._ring.modulus - 1)
